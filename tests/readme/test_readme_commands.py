"""The project README (README.md): its two commands are real, its test command is exactly what CI
runs, and every ```python block in it executes."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"

FENCE = re.compile(r"^(?P<fence>```|~~~)[ \t]*(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$",
                   re.M | re.S)


def fenced_blocks(lang: set[str]) -> list[str]:
    text = README.read_text(encoding="utf-8")
    return [m["body"] for m in FENCE.finditer(text) if m["lang"].lower() in lang]


def commands(block: str) -> list[str]:
    """The command lines of a shell block: comments and blank lines dropped, `\\` continuations joined."""
    joined = re.sub(r"\\\n", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def bash_commands() -> list[str]:
    return [c for block in fenced_blocks({"bash", "sh", "shell", "console"}) for c in commands(block)]


def ci_last_command() -> str:
    return commands(CI.read_text(encoding="utf-8"))[-1]


def steps(command: str) -> list[str]:
    return [s.strip() for s in command.split("&&")]


# ------------------------------------------------------------------------------------------------
# the two commands

def test_readme_has_the_two_commands():
    cmds = bash_commands()
    assert len(cmds) >= 2, f"README.md should open with two bash commands, found {cmds}"
    main_job, tests = cmds[0], cmds[1]
    assert shlex.split(steps(main_job)[-1])[:4] == ["python", "-m", "polyformer", "train"]
    assert "pytest" in steps(tests)[-1]


def test_main_job_command_exists(capsys):
    main_job = bash_commands()[0]
    for step in steps(main_job):
        argv = shlex.split(step)
        if argv[:3] == ["python", "-m", "polyformer"]:
            from polyformer.train.cli import overrides, parser
            from polyformer.train.settings import resolve

            args, extra = parser().parse_known_args(argv[3:])       # the flags are the command's own
            assert args.command == "train"
            resolve(args.preset, args.config, overrides(extra))     # and the settings are valid
        elif argv[:2] == ["pip", "install"]:
            _check_pip_install(argv[2:])
        else:
            pytest.fail(f"unexpected step {step!r} in the README's main command")


def _check_pip_install(args: list[str]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    for arg in (a for a in args if not a.startswith("-")):
        if arg.startswith("torch=="):
            assert torch.__version__.split("+")[0] == arg.split("==")[1], \
                f"README pins {arg} but torch {torch.__version__} is installed"
        elif "==" in arg and "[" not in arg:          # a pinned package from PyPI
            from importlib.metadata import PackageNotFoundError, version

            name, _, pinned = arg.partition("==")
            try:
                assert version(name) == pinned, f"README pins {arg} but {name} {version(name)} is installed"
            except PackageNotFoundError:
                pytest.skip(f"{name} is not installed here (the README's test command installs it)")
        else:
            target, _, extra = arg.partition("[")
            assert (ROOT / target / "pyproject.toml").exists(), f"pip install {arg}: no project at {target!r}"
            for name in filter(None, extra.rstrip("]").split(",")):
                assert name in extras, f"pip install {arg}: no extra {name!r} in pyproject.toml"


def test_test_command_steps_exist():
    tests = bash_commands()[1]
    *installs, run = steps(tests)
    for step in installs:
        argv = shlex.split(step)
        assert argv[:2] == ["pip", "install"], f"unexpected step {step!r}"
        _check_pip_install(argv[2:])
    argv = shlex.split(run)
    assert argv[:3] == ["python", "-m", "pytest"]
    assert (ROOT / argv[-1]).is_dir()


def test_readme_test_command_is_what_ci_runs():
    assert ci_last_command() == "python -m pytest -q -n 2 tests"
    assert steps(bash_commands()[1])[-1] == ci_last_command()


def test_ci_installs_what_the_readme_test_command_installs():
    ci = [" ".join(a for a in shlex.split(c, comments=True)[4:] if a != "--quiet")
          for c in commands(CI.read_text()) if shlex.split(c)[:4] == ["python", "-m", "pip", "install"]]
    readme = [" ".join(shlex.split(s)[2:]) for s in steps(bash_commands()[1])[:-1]]
    assert readme == ci


def test_main_job_pins_the_torch_ci_installs():
    """The test command's installs equal CI's (above); the main job must take the same CPU wheel."""
    pin = re.compile(r"torch==[\w.]+")
    main_job_pins = set(pin.findall(bash_commands()[0]))
    assert main_job_pins and main_job_pins == set(pin.findall(CI.read_text()))


# ------------------------------------------------------------------------------------------------
# python examples, picked up automatically as the README grows

PYTHON_BLOCKS = fenced_blocks({"python", "py", "python3"})


@pytest.mark.parametrize(
    "index", range(len(PYTHON_BLOCKS)) if PYTHON_BLOCKS else
    [pytest.param(None, marks=pytest.mark.skip(reason="README.md has no ```python block yet"))])
def test_readme_python_block_runs(index):
    code = PYTHON_BLOCKS[index]
    torch.manual_seed(0)
    namespace = {"__name__": f"readme_block_{index}"}
    exec(compile(code, f"README.md[python block {index}]", "exec"), namespace)


def test_every_section_appears_once():
    """No section twice (a bad splice once copied 570 lines of the README after itself, and the duplicated
    python blocks then ran twice as tests): each ## heading once, each ### heading once under its ##."""
    text = FENCE.sub("", README.read_text(encoding="utf-8"))          # '#' lines inside code are comments
    seen, parent = [], None
    for level, title in re.findall(r"^(##|###) (.+)$", text, re.M):
        parent = title if level == "##" else parent
        seen.append((title,) if level == "##" else (parent, title))
    assert len(seen) == len(set(seen)), sorted({s for s in seen if seen.count(s) > 1})
