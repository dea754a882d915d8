"""The `tf.distribute` strategy a training run uses (TensorFlow backend only).

Strategies (`select_strategy`):
    default       one device (TensorFlow's default strategy);
    mirrored      `MirroredStrategy` over every local GPU, or every logical
                  CPU device when there is no GPU;
    multi-worker  `MultiWorkerMirroredStrategy`, cluster from `TF_CONFIG`
                  (must be chosen before TensorFlow runs any op);
    auto          mirrored when there are several local GPUs, else default.
"""

import json
import os

from keras_transformer.training.options import STRATEGIES
from keras_transformer.utils.checks import UserError
from keras_transformer.utils.tensorflow import import_tensorflow

tf = import_tensorflow("tf.distribute strategies")


def select_strategy(name):
    """The `tf.distribute.Strategy` called `name` (one of `STRATEGIES`)."""
    if name not in STRATEGIES:
        raise UserError(f"--strategy must be one of {list(STRATEGIES)}; got {name!r}.")
    if name == "multi-worker":
        cluster = _tf_config_cluster()
        if sum(len(tasks) for role, tasks in cluster.items() if role in ("chief", "worker")) < 1:
            raise UserError(
                "--strategy multi-worker needs TF_CONFIG with a cluster of workers, "
                'e.g. {"cluster": {"worker": ["host1:port", "host2:port"]}, '
                '"task": {"type": "worker", "index": 0}}.'
            )
        return tf.distribute.MultiWorkerMirroredStrategy()
    gpus = tf.config.list_logical_devices("GPU")
    if name == "mirrored":
        if gpus:
            return tf.distribute.MirroredStrategy([device.name for device in gpus])
        # CPU devices share memory: reduce on one of them. (TF's default
        # collective ops also key their state per process, so a second
        # MirroredStrategy in the same process could collide with the first.)
        return tf.distribute.MirroredStrategy(
            [device.name for device in tf.config.list_logical_devices("CPU")],
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
        )
    if name == "auto" and len(gpus) > 1:
        return tf.distribute.MirroredStrategy([device.name for device in gpus])
    return tf.distribute.get_strategy()


def _tf_config_cluster():
    try:
        config = json.loads(os.environ.get("TF_CONFIG", "") or "{}")
    except json.JSONDecodeError as error:
        raise UserError(f"TF_CONFIG is not valid JSON ({error}).") from None
    cluster = config.get("cluster", {}) if isinstance(config, dict) else {}
    return cluster if isinstance(cluster, dict) else {}


def worker_index(strategy):
    """`(index, count)` of this worker in a multi-worker cluster; `(0, 1)` otherwise."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return 0, 1
    workers = resolver.cluster_spec().as_dict()
    count = sum(len(workers.get(role, [])) for role in ("chief", "worker"))
    index = resolver.task_id + (1 if resolver.task_type == "worker" and "chief" in workers else 0)
    return index, count
