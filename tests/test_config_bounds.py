"""Bounded configuration parsing (issue 34): a YAML alias bomb ("billion laughs") in ``--config``, in a ``--set``
value or in a deployment's overrides is refused in milliseconds with one line naming where; so is nesting deep
enough to overflow the parser's recursion. Ordinary anchors and aliases still work."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from captioning import bounded_yaml
from captioning.config import ConfigError, load_config


def bomb_flow(levels: int = 9, width: int = 9) -> str:
    """One-line billion laughs: ``width**levels`` strings once expanded (9, 9: 387 characters, 10^9 values)."""
    names = "abcdefghijklmnopqrstuvwxyz"
    parts = [f"&{names[0]} [" + ",".join(["lol"] * width) + "]"]
    parts += [f"&{names[i]} [" + ",".join([f"*{names[i - 1]}"] * width) + "]" for i in range(1, levels)]
    return "[" + ",".join(parts) + "]"


def bomb_file(path: Path, reach: bool = True) -> Path:
    """The classic document; with ``reach`` the expansion reaches a real setting (``run.name``: without the
    guard, validating it runs for minutes), else it sits in an unknown key only (unguarded: a quick error)."""
    lines = ["lol: &l0 lol"] + [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 10)]
    body = "\n".join(f"  {line}" for line in lines)
    path.write_text(f"x-anchors:\n{body}\n" + ("run:\n  name: *l9\n" if reach else ""), encoding="utf-8")
    return path


def test_loader_refuses_the_bomb_fast_and_names_where(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    with pytest.raises(bounded_yaml.YAMLLimitError, match=r"expand to more than 100,000 values") as e:
        bounded_yaml.load(bomb_flow())
    assert time.perf_counter() - t0 < 0.5
    assert "line 1, column" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(bounded_yaml.YAMLLimitError, match=r"at x-anchors\.l6 \(line 8"):
        bounded_yaml.load(bomb_file(tmp_path / "b.yaml").read_text())


def test_loader_refuses_many_aliases_deep_nesting_and_cycles() -> None:
    many = "a: &a 1\nb: [" + ",".join(["*a"] * (bounded_yaml.MAX_ALIASES + 1)) + "]\n"
    with pytest.raises(bounded_yaml.YAMLLimitError, match="more than 100 YAML aliases"):
        bounded_yaml.load(many)
    with pytest.raises(bounded_yaml.YAMLLimitError, match="nested deeper than 64 levels"):
        bounded_yaml.load("[" * 5000 + "]" * 5000)
    with pytest.raises(bounded_yaml.YAMLLimitError, match="nested deeper than 64"):
        bounded_yaml.load("\n".join(" " * i + f"k{i}:" for i in range(200)) + " 1\n")
    with pytest.raises(bounded_yaml.YAMLLimitError, match="refers to its own anchor"):
        bounded_yaml.load("a: &a [1, *a]\n")


def test_ordinary_anchors_still_load() -> None:
    doc = "base: &b {epochs: 2, lr: 0.001}\nteacher: *b\nstudent: {<<: *b, epochs: 3}\n"
    assert bounded_yaml.load(doc) == {"base": {"epochs": 2, "lr": 0.001}, "teacher": {"epochs": 2, "lr": 0.001},
                                      "student": {"epochs": 3, "lr": 0.001}}
    assert bounded_yaml.load("") is None
    cfg = load_config(overrides=["students.names=[lw, acort]"])
    assert cfg.students.names == ["lw", "acort"]


def test_config_errors_name_the_file_and_the_override(tmp_path: Path) -> None:
    # in unknown keys, so that this in-process test fails fast (not for minutes) if the guard is gone
    p = bomb_file(tmp_path / "bomb.yaml", reach=False)
    with pytest.raises(ConfigError, match=rf"^{p}: at x-anchors\.l6 .*alias bomb"):
        load_config(path=p)
    with pytest.raises(ConfigError, match=r"^override x\.y: at \[5\] .*alias bomb"):
        load_config(overrides=[f"x.y={bomb_flow()}"])
    with pytest.raises(ConfigError, match=r"^override run\.name: YAML nested deeper"):
        load_config(overrides=["run.name=" + "[" * 100 + "]" * 100])


def test_cli_refuses_bombs_in_config_set_and_deploy_with_exit_2(tmp_path: Path) -> None:
    """Through the real command in a child process (without the guard, each call runs for minutes and tens of
    GB: the timeout fails the test instead of the machine)."""
    bomb = bomb_file(tmp_path / "bomb.yaml")
    script = textwrap.dedent(f"""
        import contextlib, io, json, sys, time
        from flows.cli import build_parser, main
        import flows.deployments, flows.pipeline  # imported before the clock starts (what is timed is parsing)
        build_parser()
        out = []
        for argv in ({["config", "show", "--config", str(bomb)]!r},
                     {["config", "show", "tiny", "--set", "run.name=" + bomb_flow()]!r},
                     {["deploy", "--preset", "tiny", "--set", "run.name=" + bomb_flow()]!r}):
            err = io.StringIO()
            t0 = time.perf_counter()
            with contextlib.redirect_stderr(err):
                rc = main(argv)
            out.append({{"rc": rc, "err": err.getvalue(), "s": time.perf_counter() - t0}})
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                         env={**__import__("os").environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"})
    assert res.returncode == 0, res.stderr[-2000:]
    show_file, show_set, deploy = json.loads(res.stdout.strip().splitlines()[-1])
    for r in (show_file, show_set, deploy):
        assert r["rc"] == 2 and r["s"] < 2.0, r
        assert r["err"].count("\n") == 1 and "alias bomb" in r["err"], r
    assert str(bomb) in show_file["err"]
    assert "override run.name" in show_set["err"] and "override run.name" in deploy["err"]
    assert deploy["err"].startswith("capflow deploy: error:")


def test_deeply_nested_json_is_refused_naming_the_file(tmp_path: Path) -> None:
    """JSON inputs read whole (results, references, importer metadata) refuse absurd nesting with the caller's
    error naming the file, not a RecursionError traceback."""
    from captioning.jsonio import read_json

    deep = tmp_path / "deep.json"
    deep.write_text('{"images": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(ValueError, match=rf"^results file {deep} is nested too deeply to be read"):
        read_json(deep, "results", ValueError)


@pytest.mark.parametrize("override", ["features.max_boxes=100000000", "loader.batch_size=12345678901234567890",
                                      "features.extractor.proposals=1e9", "features.chunk_rows=10000000000"])
def test_absurd_sizes_are_refused_naming_the_key(override):
    """A size no machine can hold is a config error naming the key, not a half-made store later."""
    from captioning.config import ConfigError, load_config

    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("demo", overrides=[override])
