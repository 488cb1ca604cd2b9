"""Every code block of README.md and docs/ runs as written (issue 42).

- ```python blocks are whole programs: each runs in a folder of its own, under `torchrun` when its first line is a
  comment naming the command (`# torchrun --nproc_per_node 2 loop.py`), else under `python`.
- ```bash lines run in a folder of their own (examples/ beside them, as in a checkout), each distinct command once;
  the dry runs of our console scripts (they load nothing: their imports are their time) each in a process forked
  from one Python start that imported the installed script's entry point once;
  a line ending in a `# GPU` comment is not run: its flags are parsed by the command's own parser instead. Set-up
  lines (pip, export, printf, cd, mkdocs) and the test command itself are not run here: .ci/run runs them.
- a ```text block right after a ```bash block is that command's output: its lines (but `...`) are in what the
  command prints today, so a sample cannot drift.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SETUP = ("pip ", "export ", "printf ", "cd ", "mkdocs ", "python -m pytest", "hf download")
OUR_ENTRIES = {"examples/train_1m.py": "train", "-m ulysses_lc.train": "train", "ulysses-lc-train": "train",
               "-m ulysses_lc.eval": "eval", "ulysses-lc-eval": "eval"}
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str


def code_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        blocks.append(Block(path.relative_to(REPO).as_posix(), text[:m.start()].count("\n") + 1, m.group(1), m.group(2)))
    return blocks


BLOCKS = [b for page in PAGES for b in code_blocks(page)]


def shell_lines(block: Block) -> list[tuple[str, str]]:
    """(command, trailing comment) of each line of a shell block; continuation lines joined."""
    lines, pending = [], ""
    for raw in block.text.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        raw, pending = pending + raw, ""
        if not raw.strip() or raw.strip().startswith("#"):
            continue
        cut = comment_start(raw)
        command, comment = (raw[:cut], raw[cut + 1:]) if cut is not None else (raw, "")
        lines.append((command.strip(), comment.strip()))
    return lines


def comment_start(line: str) -> int | None:
    """Where a shell comment starts: a `#` after whitespace, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return i
    return None


def is_gpu(comment: str) -> bool:
    return comment.split(":")[0].split()[0:1] == ["GPU"] if comment else False


SHELL = [(b, cmd, comment) for b in BLOCKS if b.lang in ("bash", "sh", "shell") for cmd, comment in shell_lines(b)]
RUNNABLE = sorted({cmd for _, cmd, comment in SHELL if not is_gpu(comment) and not cmd.startswith(SETUP)})
GPU_ONLY = [(b, cmd) for b, cmd, comment in SHELL if is_gpu(comment)]


def our_args(command: str) -> tuple[str, list[str]] | None:
    """(which parser, the arguments after our entry point), or None for a command that is not ours."""
    for entry, parser in OUR_ENTRIES.items():
        if f" {entry} " in f" {command} " or command.startswith(entry + " ") or command == entry:
            after = command.split(entry, 1)[1]
            return parser, shlex.split(after)
    return None


def env_for_runs() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def workdir(tmp_path: Path) -> Path:
    """A folder of its own with the checkout's examples/ beside it, as a user who cloned the repository has."""
    for name in ("examples", "ds_configs"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def test_pages_have_code_blocks_and_every_block_is_known():
    assert len(PAGES) > 10, PAGES
    unknown = [(b.page, b.line, b.lang) for b in BLOCKS if b.lang not in ("python", "bash", "sh", "shell", "text", "")]
    assert unknown == [], f"code blocks of a language this test does not run: {unknown}"
    assert any(b.lang == "python" for b in BLOCKS) and RUNNABLE and GPU_ONLY


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: f"{b.page}:{b.line}")
def test_python_block_runs_as_written(block, tmp_path):
    program = tmp_path / "snippet.py"
    program.write_text(block.text)
    first = block.text.splitlines()[0]
    if first.startswith("# torchrun "):
        argv = shlex.split(first[2:])
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:-1], str(program)]
    else:
        argv = [sys.executable, str(program)]
    result = subprocess.run(argv, cwd=workdir(tmp_path), env=env_for_runs(), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"{block.page}:{block.line} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def forked_entry(command: str) -> bool:
    """Whether a command is one of our console scripts with plain arguments and --dry-run (loads nothing, trains
    nothing): its imports are the whole of its time, so the dry runs share one Python start (dry_run_outputs).
    Anything with shell syntax, another program, or a name that is not an installed console script runs in bash."""
    words = command.split()
    return words[0] in OUR_SCRIPTS and "--dry-run" in words[1:] and not set(command) & set("|&;<>()$`\\*?[]{}~=!")


OUR_SCRIPTS = {entry for entry in OUR_ENTRIES if entry.startswith("ulysses-lc-")}  # pyproject's [project.scripts]
FORK_DRIVER = """
import importlib
import importlib.metadata
import json
import os
import shlex
import sys
import traceback

folder, commands = sys.argv[1], json.loads(sys.argv[2])
scripts = {ep.name: ep for ep in importlib.metadata.entry_points(group="console_scripts")}
entries = {name: scripts[name].load() for name in {shlex.split(c)[0] for c in commands}}  # the imports, once
# and what a dry run imports on its way (python -X importtime: 7 of its 16 s), so that no child repeats it
for module in ("accelerate.utils.deepspeed", "deepspeed", "transformers.activations", "transformers.masking_utils",
               "transformers.modeling_utils"):
    importlib.import_module(module)
for i, command in enumerate(commands):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()  # each command a process of its own, as from the shell, after the imports
    if pid == 0:
        out = os.open(f"{folder}/{i}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(out, 2)
        argv = shlex.split(command)
        sys.argv = argv
        try:  # what the installed script does, sys.exit(main()), and how Python ends on what it raises
            sys.exit(entries[argv[0]]())
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    status = os.waitpid(pid, 0)[1]
    with open(f"{folder}/{i}.rc", "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""


@pytest.fixture(scope="module")
def dry_run_outputs(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """(exit code, output) of each dry-run line, each in a process of its own forked from one Python start that did
    the imports (seconds each on 2 cores) once, from a folder of its own; what that start printed is part of each."""
    commands = [c for c in RUNNABLE if forked_entry(c)]
    folder = workdir(tmp_path_factory.mktemp("dry_runs"))
    proc = subprocess.run([sys.executable, "-c", FORK_DRIVER, str(folder), json.dumps(commands)], cwd=folder,
                          env=env_for_runs(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {c: (int((folder / f"{i}.rc").read_text()), proc.stdout + proc.stderr + (folder / f"{i}.out").read_text())
            for i, c in enumerate(commands)}


@pytest.mark.parametrize("command", RUNNABLE)
def test_shell_command_runs_as_written(command, tmp_path, request):
    if forked_entry(command):
        returncode, output = request.getfixturevalue("dry_run_outputs")[command]
    else:
        result = subprocess.run(["bash", "-c", command], cwd=workdir(tmp_path), env=env_for_runs(),
                                capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        returncode, output = result.returncode, result.stdout + result.stderr
    samples = samples_after(command)
    # A sample that shows the command's refusal (a dry run that does not fit) documents exit code 1.
    refused = any(line.lstrip().startswith("error:") for _, sample in samples for line in sample)
    assert returncode == int(refused), f"{command!r} exited {returncode}:\n{output[-5000:]}"
    for block, sample in samples:
        missing = [line for line in sample if line.strip() not in output]
        assert missing == [], f"{block.page}:{block.line}: the sample output has drifted from the tool's:\n" \
                              f"{missing}\n--- the tool printed:\n{output[-4000:]}"


def samples_after(command: str) -> list[tuple[Block, list[str]]]:
    """The ```text blocks that follow a ```bash block holding this one command: the lines to find in its output."""
    found = []
    for i, block in enumerate(BLOCKS[:-1]):
        after = BLOCKS[i + 1]
        if block.lang == "bash" and after.lang == "text" and after.page == block.page and \
                [c for c, _ in shell_lines(block)] == [command]:
            found.append((after, [line for line in after.text.splitlines() if line.strip() and line.strip() != "..."]))
    return found


@pytest.mark.parametrize("block,command", GPU_ONLY, ids=lambda x: x if isinstance(x, str) else f"{x.page}:{x.line}")
def test_gpu_command_flags_are_the_tools(block, command):
    ours = our_args(command)
    if ours is None:
        return  # a launcher line of another tool's (srun, mpirun): nothing of ours to check
    tool, args = ours
    from ulysses_lc.eval.cli import build_parser as eval_parser
    from ulysses_lc.train import build_parser as train_parser

    try:
        {"train": train_parser, "eval": eval_parser}[tool]().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{block.page}:{block.line}: `{command}` has flags `ulysses-lc-{tool} --help` does not list ({e})")
