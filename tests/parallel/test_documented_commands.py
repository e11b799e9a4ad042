"""Every `ember train` command in README.md, docs/ and examples/ passes ember's layout
checks, so a documented launch line cannot be one that ember refuses.

A command is a (backslash-joined) line that starts with `torchrun`, `srun`, `ember train`
or `python -m ember`, or an inline `...` span holding `ember train`. A line of `--set`
options alone is another layout for the command above it in the same file: its recipe,
process count and non-parallel settings with these `parallel.*` keys. Shell
scripts (examples/) have their `NAME=value` variables and `#SBATCH --nodes` substituted.
The world size is `--nproc-per-node` x `--nnodes` (1 without torchrun), and the recipe's
model is the one checked (a vocabulary taken from the data counts as 8192 tokens)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO
from ember.config import ConfigError, load_config
from ember.layout import check_run

# Recipe arguments that stand for "your recipe" in the prose.
PLACEHOLDERS = {"CFG", "CONFIG", "...", "DIR/best.toml"}
STARTS = ("torchrun ", "srun ", "ember train ", "python -m ember ")


@dataclass
class Command:
    where: str  # file:line
    recipe: str
    world: int
    sets: list[str]


def _sources() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return files + sorted(p for p in (REPO / "examples").rglob("*") if p.is_file())


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, line) with backslash continuations joined."""
    out, buffer, first = [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not buffer:
            first = number
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
            continue
        out.append((first, buffer + line))
        buffer = ""
    return out


def _substitute(text: str) -> str:
    """A shell script's own variables, and Slurm's node count from its #SBATCH line."""
    values = dict(re.findall(r"^([A-Z_]+)=(\S+)", text, flags=re.M))
    nodes = re.search(r"^#SBATCH --nodes=(\d+)", text, flags=re.M)
    if nodes:
        values["SLURM_NNODES"] = nodes.group(1)
    for name, value in values.items():
        text = re.sub(r"\$\{?" + name + r"\}?(?![\w\[])", value, text)
    return text


def _option(tokens: list[str], names: tuple[str, ...]) -> str | None:
    for i, token in enumerate(tokens):
        for name in names:
            if token == name and i + 1 < len(tokens):
                return tokens[i + 1]
            if token.startswith(name + "="):
                return token.split("=", 1)[1]
    return None


def _sets(tokens: list[str]) -> list[str]:
    out = []
    for i, token in enumerate(tokens):
        if token == "--set" and i + 1 < len(tokens):
            out.append(tokens[i + 1])
        elif token.startswith("--set="):
            out.append(token.split("=", 1)[1])
    return out


def _parse(line: str, where: str) -> Command | None:
    tokens = [t for t in shlex.split(line, comments=True) if not t.startswith("$")]
    if "train" not in tokens or "ember" not in " ".join(tokens):
        return None
    at = tokens.index("train")
    if at + 1 == len(tokens):
        return None  # the verb named in prose
    recipe = tokens[at + 1]
    launcher = tokens[:at]
    world = 1
    if any(t.endswith("torchrun") or t == "torch.distributed.run" for t in launcher):
        nproc = _option(launcher, ("--nproc-per-node", "--nproc_per_node")) or "1"
        nnodes = _option(launcher, ("--nnodes",)) or "1"
        world = int(nproc) * int(nnodes) if nproc.isdigit() and nnodes.isdigit() else -1
    return Command(where, recipe, world, _sets(tokens[at + 2:]))


def documented_commands(path: Path, text: str | None = None) -> list[Command]:
    text = path.read_text() if text is None else text
    if path.suffix != ".md":
        text = _substitute(text)
    commands: list[Command] = []
    base: Command | None = None
    for number, line in _logical_lines(text):
        where = f"{path.relative_to(REPO)}:{number}"
        stripped = line.strip().removeprefix("$ ")
        if stripped.startswith(STARTS):
            command = _parse(stripped, where)
            if command is not None:
                commands.append(command)
                base = command
        elif stripped.startswith("--set") and base is not None:
            sets = [s for s in base.sets if not s.startswith("parallel.")] + _sets(shlex.split(stripped, comments=True))
            commands.append(Command(where, base.recipe, base.world, sets))
        else:
            for span in re.findall(r"`([^`]*ember train[^`]*)`", line):
                command = _parse(span, where)
                if command is not None:
                    commands.append(command)
    return commands


def check_command(command: Command) -> None:
    """ember's own checks of the command's recipe, settings and layout (ConfigError if refused)."""
    cfg = load_config(REPO / command.recipe, command.sets)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = 8192
    check_run(cfg, command.world)


ALL = [c for path in _sources() for c in documented_commands(path)]
CHECKED = [c for c in ALL if c.recipe not in PLACEHOLDERS]


def test_the_documents_hold_the_commands_this_test_is_meant_for():
    where = {c.where.split(":")[0] for c in CHECKED}
    assert {"README.md", "docs/launching.md", "docs/parallel.md", "examples/slurm/train.sbatch"} <= where
    assert sum(c.world > 1 for c in CHECKED) >= 10
    sbatch = [c for c in CHECKED if c.where.startswith("examples/slurm")]
    assert [c.world for c in sbatch] == [32]  # 4 nodes x 8 GPUs, read from the script
    for command in ALL:  # a recipe that is neither a file nor a placeholder is a typo in the docs
        assert command.recipe in PLACEHOLDERS or (REPO / command.recipe).is_file(), command
        assert command.recipe in PLACEHOLDERS or command.world >= 1, command


@pytest.mark.parametrize("command", CHECKED, ids=[f"{c.where}" for c in CHECKED])
def test_documented_command_passes_ember_layout_checks(command):
    try:
        check_command(command)
    except ConfigError as err:
        pytest.fail(f"{command.where}: `ember train {command.recipe} --set {' --set '.join(command.sets)}` on "
                    f"{command.world} processes is refused: {err}")


def test_a_refused_layout_in_a_document_is_caught():
    doc = """
```bash
torchrun --nproc_per_node=8 -m ember train configs/llama-1b.toml --data d --out r \\
    --set parallel.tp=2 --set parallel.sp=true --set parallel.pp=2 --set parallel.vpp=2 \\
    --set parallel.schedule=1f1b --set parallel.zero=1
--set parallel.zero=3         # fine: ZeRO-3 over 8
--set parallel.tp=8 --set parallel.dp_replicate=4 --set parallel.zero=1
```
"""
    commands = documented_commands(REPO / "README.md", doc)
    assert [(c.world, c.recipe) for c in commands] == [(8, "configs/llama-1b.toml")] * 3
    with pytest.raises(ConfigError, match="needs parallel.schedule=interleaved"):
        check_command(commands[0])
    check_command(commands[1])
    assert "train.global_batch" not in " ".join(commands[2].sets)
    with pytest.raises(ConfigError):
        check_command(commands[2])
