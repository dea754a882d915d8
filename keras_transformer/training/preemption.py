"""Preemption: SIGTERM (what Kubernetes and batch schedulers send before they
kill a job) and SIGINT (Ctrl-C) stop training at the next step boundary with
the resumable state saved, instead of losing everything since the last save.

`StopSignals` turns the first signal into a request (a second one stops the
process at once; the atomic writes keep the last saved state intact), and the
`StopAtStepBoundary` callback honours it: after the current batch it saves the
state through `TrainingState` and raises `Preempted`, which the trainer turns
into status `preempted` in `metrics.json` and the command line into exit
status `EXIT_PREEMPTED`. The same command with `--resume` continues.
"""

import signal
import threading

import keras

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure; run the command again


class Preempted(Exception):
    """Training stopped on a signal after `step` batches of epoch `epoch` (0-based), state saved."""

    def __init__(self, signal_name, epoch, step):
        super().__init__(f"stopped by {signal_name} at epoch {epoch + 1}, step {step}")
        self.signal_name, self.epoch, self.step = signal_name, epoch, step


class StopSignals:
    """While active (a context manager), SIGTERM and SIGINT request a stop instead of killing.

    `requested` holds the first signal's name (None before). A second signal
    restores the handler that was there before and is delivered again: SIGTERM's
    default stops the process at once, SIGINT's raises `KeyboardInterrupt`.
    A signal the process ignores (SIGINT in a background job of a
    non-interactive shell, `nohup`) stays ignored. Outside the main thread
    Python cannot install signal handlers; there the context does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, log=print):
        self.log, self.requested, self._previous = log, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                if signal.getsignal(number) is not signal.SIG_IGN:
                    self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number, frame):
        name = signal.Signals(number).name
        if self.requested:
            previous = self._previous.pop(number, signal.SIG_DFL)
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
            signal.raise_signal(number)
            return
        self.requested = name
        self.log(
            f"Received {name}: stopping after the current step and saving the state "
            f"(send it again to stop at once)."
        )


class StopAtStepBoundary(keras.callbacks.Callback):
    """Honours a `StopSignals` request after the current batch (see the module docstring).

    Put it last among `fit`'s callbacks, so that the others have seen the batch.
    Mid-epoch it saves the state (`state.save`) and raises `Preempted`; on an
    epoch's last batch it lets the epoch end (validation, checkpoints and the
    epoch's state) and raises from `on_epoch_end`.

    Args:
        signals: the `StopSignals`.
        state: the run's `checkpoints.TrainingState` callback.
    """

    def __init__(self, signals, state):
        super().__init__()
        self.signals, self.state, self.epoch = signals, state, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not self.signals.requested or self.model.stop_training:
            return  # no request, or a NaN stop is under way
        if batch + 1 >= (self.params or {}).get("steps", float("inf")):
            return  # the epoch's last batch: stop once the epoch has ended
        step = self.state.first_step + batch + 1
        self.state.save(self.epoch, step)
        raise Preempted(self.signals.requested, self.epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        if self.signals.requested and not self.model.stop_training:
            raise Preempted(self.signals.requested, epoch + 1, 0)
