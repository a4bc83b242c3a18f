"""The command line: exit status 2 with one clear paragraph for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from driver.cli import main, parse_size

BAD = "tests/model_files"
GOOD = f"{BAD}/good_tiny.py"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, " ".join(err.split()) if "\n\n" not in err.strip() else err


@pytest.mark.parametrize(
    "model, pattern",
    [
        ("tests/model_files/does_not_exist.py", r"cannot be read \(no such file\)"),
        (f"{BAD}/syntax_error.py", r"line \d+: syntax error"),
        (f"{BAD}/import_error.py", r"importing it raised ModuleNotFoundError"),
        (f"{BAD}/no_build_model.py", r"defines no `build_model\(\)`"),
        (f"{BAD}/build_returns_int.py", r"build_model\(\) returned int, not a torch.nn.Module"),
        (f"{BAD}/build_raises.py", r"build_model\(\) raised ValueError: boom"),
        (f"{BAD}/no_example_inputs.py", r"defines no `example_inputs\(\)`"),
        (f"{BAD}/wrong_shape.py", r"could not trace the model.*wrong_shape.py, line \d+"),
        (f"{BAD}/data_dependent.py", r"could not trace the model at .*data_dependent.py, line \d+.*control flow"),
    ],
)
def test_bad_model_files(model: str, pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(capsys, "compile", model, "--out", str(tmp_path / "pkg"), "--quiet")
    assert code == 2
    assert "Traceback" not in err
    assert err.startswith("partitioner: error: ")
    import re

    assert re.search(pattern, " ".join(err.split())), err
    assert not (tmp_path / "pkg").exists(), "nothing is written on failure"


@pytest.mark.parametrize(
    "options, pattern",
    [
        (["--stages", "0"], r"--stages 0: a pipeline needs at least 1 stage"),
        (["--stages", "500", "--microbatches", "1"], r"--stages 500 is more than the \d+ blocks the graph coarsened into.*use --stages \d+ or fewer"),
        (["--schedule", "zigzag"], r"unknown --schedule 'zigzag'"),
        (["--memory", "1KiB"], r"needs at least .* on one stage.*but --memory is 1.0 KiB per stage: raise --memory to"),
        (["--memory", "lots"], r"is not a size"),
        (["--microbatches", "3"], r"does not split into 3 microbatches"),
        (["--dp", "3", "--microbatches", "2"], r"--dp 3 does not divide 8 rows: use --dp 1 or 2 or 4, or an example "
                                               r"batch of a multiple of 2 x 3 = 6 rows \(e.g. 12\)"),
        (["--tracer", "magic"], r"unknown --tracer 'magic'"),
        (["--hardware", "tpu9"], r"unknown --hardware 'tpu9'"),
        (["--tp", "0"], r"--tp 0: the tensor-parallel degree is at least 1"),
        (["--zero", "2"], r"--zero 2: choose 0 \(optimizer state on every replica\) or 1"),
        (["--devices", "6", "--tp", "4"], r"no mesh stages x tp x dp = 6 devices suits the options"),
        (["--devices", "4", "--stages", "2", "--tp", "4"], r"no mesh stages x tp x dp = 4 devices suits the options"),
        (["--devices", "4", "--stages", "2", "--tp", "4", "--microbatches", "2", "--zero", "0", "--schedule", "1f1b"],
         r"--stages 2 x --tp 4 x --dp 1 != --devices 4"),
    ],
)
def test_bad_options(options: list[str], pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    code, err = _run(capsys, "compile", GOOD, "--out", str(tmp_path / "pkg"), "--quiet", "--analytic", *options)
    assert code == 2, err
    assert "Traceback" not in err
    assert re.search(pattern, " ".join(err.split())), err


@pytest.mark.parametrize("batch, microbatches, dp, fix", [
    (16, 4, 3, r"--dp 3 does not divide 16 rows: use --dp 1 or 2 or 4, or an example batch of a multiple of "
               r"4 x 3 = 12 rows \(e.g. 24\)\.$"),
    (16, 3, 2, r"use --microbatches 2 \(any of \[1, 2, 4, 8\]\) or an example batch of a multiple of 3 x 2 = 6 rows"),
    (5, 2, 3, r"no --dp divides 5 rows into 2 microbatches: use an example batch of a multiple of 2 x 3 = 6 rows"),
])
def test_a_batch_that_does_not_split_names_a_fix_that_works(batch: int, microbatches: int, dp: int, fix: str) -> None:
    """Every count the message suggests splits the batch (the --dp 3 on 16 rows once said
    "use --microbatches 1 (any of [])")."""
    import re

    from driver.options import rows_per_microbatch
    from partitioner.errors import PlanError

    with pytest.raises(PlanError) as raised:
        rows_per_microbatch(batch, microbatches, dp)
    said = str(raised.value)
    assert re.search(fix, said), said
    dps = re.search(r"use --dp ([\d or]+)", said)
    for d in map(int, dps.group(1).split(" or ") if dps else []):
        assert rows_per_microbatch(batch, microbatches, d) > 0
    for m in map(int, re.findall(r"--microbatches (\d+)", said)):
        assert rows_per_microbatch(batch, m, dp) > 0
    resized = int(re.search(r"e\.g\. (\d+)", said).group(1))
    assert rows_per_microbatch(resized, microbatches, dp) > 0


def test_out_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "file"
    out.write_text("x")
    code, err = _run(capsys, "compile", GOOD, "--out", str(out), "--quiet")
    assert code == 2 and "is a file, not a folder" in err


def test_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", GOOD, "--out", str(tmp_path / "pkg"), "--quiet", "--analytic"]) == 0
    capsys.readouterr()
    assert main(["show", str(tmp_path / "pkg")]) == 0
    out = capsys.readouterr().out
    assert out == (tmp_path / "pkg" / "plan.txt").read_text()
    assert "stage" in out and "ranks" in out


def test_show_missing_and_corrupt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(capsys, "show", str(tmp_path / "nothing"))
    assert code == 2 and "is not a package directory" in err
    (tmp_path / "bad").mkdir()
    code, err = _run(capsys, "show", str(tmp_path / "bad"))
    assert code == 2 and "has no manifest.json" in err
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    code, err = _run(capsys, "show", str(tmp_path / "bad"))
    assert code == 2 and "is corrupt" in err
    (tmp_path / "bad" / "manifest.json").write_text(json.dumps({"stages": []}))
    code, err = _run(capsys, "show", str(tmp_path / "bad"))
    assert code == 2 and "corrupt" in err


def test_recompile_is_byte_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Measured costs too: the profile cache makes the second compile agree."""
    for out in ("a", "b"):
        assert main(["compile", GOOD, "--out", str(tmp_path / out), "--quiet"]) == 0
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_subprocess_exit_status(tmp_path: Path) -> None:
    """The real entry point: exit 2, a paragraph, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "partitioner", "compile", f"{BAD}/no_build_model.py", "--out", str(tmp_path / "p")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "build_model" in proc.stderr


@pytest.mark.parametrize("text, size", [("16GiB", 16 << 30), ("512MiB", 512 << 20), ("80GB", 80 * 10**9), ("1000", 1000)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


def _package_files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name != "__pycache__"}


def test_out_dot_keeps_the_users_files_and_the_working_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`--out .` beside the model file: refused (exit 2, the folder and --force named); with
    --force the package is written beside the user's files, the working directory stays the
    same folder, and a later compile replaces only the package's files."""
    (tmp_path / "my_model.py").write_text(Path(GOOD).read_text())
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    before = tmp_path.stat().st_ino
    args = ["compile", "my_model.py", "--out", ".", "--analytic", "--quiet"]
    code, err = _run(capsys, *args, "--stages", "3")
    assert code == 2 and "Traceback" not in err
    assert "'.'" in err and "my_model.py, notes.txt" in err and "--force" in err, err
    assert _package_files(tmp_path) == {"my_model.py", "notes.txt"}
    assert _run(capsys, *args, "--stages", "3", "--force")[0] == 0
    assert {"my_model.py", "notes.txt", "manifest.json", "stage_2.py"} <= _package_files(tmp_path)
    assert Path.cwd().stat().st_ino == before and (tmp_path / "notes.txt").read_text() == "mine"
    assert _run(capsys, *args, "--stages", "2", "--force")[0] == 0
    assert "stage_2.py" not in _package_files(tmp_path)  # the earlier package's own file, gone
    assert {"my_model.py", "notes.txt", "stage_1.py"} <= _package_files(tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["mesh"]["pp"] == 2


def test_out_folder_of_other_files_is_refused_and_forced_keeps_them(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mydata"
    out.mkdir()
    (out / "important.txt").write_text("mine")
    args = ["compile", GOOD, "--out", str(out), "--analytic", "--quiet"]
    code, err = _run(capsys, *args)
    assert code == 2 and "important.txt" in err and "--force" in err and str(out) in err, err
    assert _package_files(out) == {"important.txt"}
    assert _run(capsys, *args, "--force")[0] == 0
    assert (out / "important.txt").read_text() == "mine" and (out / "manifest.json").is_file()
    (out / "plan.txt").unlink()
    (out / "plan.txt").write_text("my plan")  # a file of a package's name that the compiler did not write
    (out / "manifest.json").unlink()
    code, err = _run(capsys, *args, "--force")
    assert code == 2 and "plan.txt" in err and "overwrite" in err, err
    assert (out / "plan.txt").read_text() == "my plan"


def test_an_earlier_package_is_replaced_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An earlier package (its manifest stamped by partitioner) goes whole, stale stages
    included; a manifest.json another program wrote is not taken for one."""
    args = ["compile", GOOD, "--analytic", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "pkg"), "--stages", "3"]) == 0
    assert main([*args, "--out", str(tmp_path / "pkg"), "--stages", "2"]) == 0
    assert main([*args, "--out", str(tmp_path / "fresh"), "--stages", "2"]) == 0
    assert _package_files(tmp_path / "pkg") == _package_files(tmp_path / "fresh")
    for name in _package_files(tmp_path / "fresh"):
        assert (tmp_path / "pkg" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name
    other = tmp_path / "app"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"name": "my app", "stages": []}))
    code, err = _run(capsys, *args, "--out", str(other))
    assert code == 2 and "manifest.json" in err
    assert _package_files(other) == {"manifest.json"}
