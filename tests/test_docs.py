"""Every code block of the README and `docs/` runs, so none can rot.

Each document's blocks run in order, in a workspace of their own that holds
what the documents assume a user has:

- `runs/demo`: a trained run (`make demo` makes it; here the suite's tiny run,
  `conftest.trained_run`);
- `data/{train,val,test}.{en,de}`: aligned text files (synthetic pairs).

A ```` ```python ```` block runs in the document's namespace (the blocks of one
document share it, as a reader's session would), a ```` ```bash ```` block in
`bash -euo pipefail` with this environment's `keras-transformer` on the PATH,
both with the workspace as the working directory. A ```` ```text ```` block is
output or a listing, not code. A block that cannot run here (Docker, an
install, hours of training) has `<!-- not run: REASON -->` on the line above
it; the reasons are listed by `test_blocks_that_do_not_run_say_why`.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash", "text")
FENCE = re.compile(r"^```(\S*)(.*)$")
NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")


def code_blocks(document):
    """`[(line, language, code, reason not run or None)]` of a Markdown file's fenced blocks."""
    lines = (ROOT / document).read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        previous = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        reason = NOT_RUN.match(previous.strip())
        code = "\n".join(lines[index + 1 : end]) + "\n"
        blocks.append((index + 1, opening.group(1), code, reason.group(1) if reason else None))
        index = end + 1
    return blocks


def test_every_block_says_its_language():
    wrong = [
        f"{document}:{line} ```{language}"
        for document in DOCUMENTS
        for line, language, _, _ in code_blocks(document)
        if language not in LANGUAGES
    ]
    assert not wrong, f"a code block must be one of {LANGUAGES}: {wrong}"


def test_blocks_that_do_not_run_say_why():
    skipped = [
        (f"{document}:{line}", reason)
        for document in DOCUMENTS
        for line, language, _, reason in code_blocks(document)
        if reason
    ]
    assert all(len(reason.split()) >= 3 for _, reason in skipped), skipped
    # Deliberately few: a block that could run here must run.
    assert len(skipped) <= 12, skipped


@pytest.fixture
def workspace_template(request, synthetic_files, tmp_path_factory):
    """`runs/demo` and `data/` as the documents assume them: `runs/demo` is the suite's
    `trained_run`, or for the documents that conftest.py sends to the other worker the cheaper
    `document_run` (no document needs more than a run directory with a model and a tokenizer)."""
    from keras_transformer.data.synthetic import SyntheticLanguagePair

    group = request.node.get_closest_marker("xdist_group")
    own = group is not None and group.args[0] == "document_run"
    run = request.getfixturevalue("document_run" if own else "trained_run")
    template = tmp_path_factory.mktemp("docs-workspace")
    shutil.copytree(run, template / "runs" / "demo", ignore=shutil.ignore_patterns("*.lock"))
    data = template / "data"
    data.mkdir()
    for path in synthetic_files:
        shutil.copy(path, data / path.name)
    corpus = SyntheticLanguagePair().corpus(
        {"val": 10, "test": 10}, seed=11
    )  # decoding an undertrained model is slow
    for split in ("val", "test"):
        sources, targets = corpus[split]
        (data / f"{split}.en").write_text("\n".join(sources) + "\n", encoding="utf-8")
        (data / f"{split}.de").write_text("\n".join(targets) + "\n", encoding="utf-8")
    return template


def _runnable(document):
    return [block for block in code_blocks(document) if block[1] in ("python", "bash") and not block[3]]


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if _runnable(d)])
def test_document_code_runs(document, workspace_template, tmp_path, monkeypatch):
    workspace = tmp_path / "workspace"
    shutil.copytree(workspace_template, workspace)
    monkeypatch.chdir(workspace)
    environment = dict(
        os.environ,
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    namespace = {"__name__": f"docs:{document}"}
    for line, language, code, _ in _runnable(document):
        where = f"{document}:{line}"
        if language == "python":
            try:
                exec(compile(code, where, "exec"), namespace)
            except Exception as error:  # the block's place first: the traceback is the reader's
                raise AssertionError(f"the Python block at {where} failed: {error!r}") from error
        else:
            completed = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", code],
                cwd=workspace,
                env=environment,
                capture_output=True,
                text=True,
                timeout=900,
                stdin=subprocess.DEVNULL,
            )
            assert completed.returncode == 0, (
                f"the bash block at {where} exited with {completed.returncode}:\n{code}\n"
                f"stderr:\n{completed.stderr[-3000:]}"
            )


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("document", DOCUMENTS)
def test_relative_links_point_at_files_that_exist(document):
    """A link to a file of the repository (relative to the document) finds it."""
    path = ROOT / document
    targets = LINK.findall(path.read_text(encoding="utf-8"))
    missing = [t for t in targets if "://" not in t and not (path.parent / t).exists()]
    assert not missing, f"{document} links to missing files: {missing}"


CITED_FILE = re.compile(r"(?<![\w/.-])((?:results|docs|scripts|tests)/[\w./-]*\w\.(?:json|png|py|sh|md))")


def _tracked_files():
    """The repository's tracked files (`git ls-files`), or None outside a git checkout."""
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return set(listed.stdout.splitlines())


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_file_a_document_cites_is_tracked(document):
    """A figure's file (`results/*.json`) or a script a document names is a
    file of the repository, committed: no citation of a file that is missing or only on one machine.
    Placeholders in capitals (`results/NAME.json`) and `git show COMMIT:PATH` citations are not files."""
    text = (ROOT / document).read_text(encoding="utf-8")
    text = re.sub(r"git show \w+:\S+", "", text)
    cited = {
        path for path in CITED_FILE.findall(text) if not re.search(r"(?<![a-z])[A-Z]{3,}(?![a-z])", path)
    }
    tracked = _tracked_files()
    if tracked is None:  # an exported tree, not a checkout: existence only
        missing = sorted(path for path in cited if not (ROOT / path).is_file())
    else:
        missing = sorted(path for path in cited if path not in tracked)
    assert not missing, f"{document} cites files that are not tracked: {missing}"


def _block_lines(document, language):
    return {
        line.split("#")[0].strip()
        for _, block_language, code, reason in code_blocks(document)
        if block_language == language and not reason
        for line in code.splitlines()
        if line.split("#")[0].strip()
    }


def test_the_readmes_export_blocks_run_in_the_deployment_documents_test():
    """The README's export commands and its ONNX Runtime code are not run in the README's own test
    (each export takes a minute): docs/deployment.md, whose blocks run, holds them line for line."""
    readme = [
        (language, code)
        for _, language, code, reason in code_blocks("README.md")
        if reason and reason.startswith("docs/deployment.md")
    ]
    assert len(readme) == 2
    for language, code in readme:
        lines = {line.split("#")[0].strip() for line in code.splitlines() if line.split("#")[0].strip()}
        assert lines <= _block_lines("docs/deployment.md", language), lines - _block_lines(
            "docs/deployment.md", language
        )
