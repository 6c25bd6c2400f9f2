"""The command line on real files: output, exit codes (0 ok, 1 found, 2 bad input), hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tuning import commands as cli
from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.identity import config_data, config_signature, kernel_id, kernel_source_hash
from megatron_tuning.core.key import Key
from megatron_tuning.tables.entry import Entry, Timing
from megatron_tuning.tables.records import write_decisions, write_recording
from megatron_tuning.tables.table import Table, load_table, save_table

from . import support_kernels as sk
from .keys import ma, nx

REPO = Path(__file__).resolve().parent.parent
KERNEL = "pkg.kernels:matmul"


M1 = ma(1)


def entry(block: int, key: Key = M1, **changes: object) -> Entry:
    fields: dict[str, object] = {
        "arch": "sm90",
        "kernel": KERNEL,
        "key": key,
        "how": "tuned",
        "config": {"kwargs": {"BLOCK": block}, "num_warps": 4, "num_stages": 3},
        "timing": Timing(median_ms=0.25, spread_ms=0.02, candidates=8, runner_up_ms=0.26),
    }
    fields.update(changes)
    return Entry(**fields)  # type: ignore[arg-type]


@pytest.fixture
def table_path(tmp_path: Path) -> Path:
    path = tmp_path / "t.msgpack"
    save_table(
        Table(
            [
                entry(64),
                entry(128, key=ma(2)),
                entry(32, arch="sm80", kernel="pkg.other:gemm"),
            ]
        ),
        path,
    )
    return path


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- help and usage ----------------------------------------------------------------
@pytest.mark.parametrize(
    "command", ["show", "export", "import", "diff", "merge", "validate", "coverage", "cache"]
)
def test_every_command_has_help(capsys, command):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    assert "usage: megatron-tuning " + command in capsys.readouterr().out


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["frobnicate"], ["diff", "only-one"], ["show"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2


def test_python_dash_m_reports_bad_input_without_traceback(tmp_path):
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\xff\x00 not a table")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_tuning", "show", str(bad)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert str(bad) in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


# -- show / export / import --------------------------------------------------------
def test_a_reader_that_stops_early_gives_141_not_a_pass(tmp_path, table_path):
    """``diff a b | head -1`` under pipefail: output cut short is not "no differences" (0)."""
    other = tmp_path / "other.msgpack"
    save_table(Table([entry(256, key=ma(n)) for n in range(1, 4000)]), other)
    script = f"set -o pipefail; {sys.executable} -m megatron_tuning diff {table_path} {other} | head -c 10"
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 141 and b"Traceback" not in done.stderr, done.stderr


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    def interrupted(args):  # noqa: ANN001, ANN202
        raise KeyboardInterrupt

    parser = cli.build_parser(["cache"])
    parsed = parser.parse_args(["cache"])
    parsed.handler = interrupted
    monkeypatch.setattr(parser, "parse_args", lambda argv: parsed)
    monkeypatch.setattr(cli, "build_parser", lambda argv: parser)
    assert cli.main(["cache"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_show_lists_entries_with_provenance_and_filters(capsys, table_path):
    code, out, _ = run(capsys, "show", table_path)
    assert code == 0
    assert "sm90  pkg.kernels:matmul" in out and "[M=2 | a:torch.float16]" in out
    assert "BLOCK=64, num_warps=4, num_stages=3  (tuned, median 0.25 ms" in out and "runner-up +4.0%" in out
    code, out, _ = run(capsys, "show", table_path, "--arch", "sm80")
    assert code == 0 and "pkg.other:gemm" in out and "matmul" not in out
    code, out, _ = run(capsys, "show", table_path, "--kernel", "pkg.*:mat*")
    assert "gemm" not in out and "1 of 3" not in out and "2 of 3 entries" in out
    code, out, _ = run(capsys, "show", table_path, "--kernel", "gemm", "--json")
    assert [e["kernel"] for e in json.loads(out)["entries"]] == ["pkg.other:gemm"]


def test_show_says_a_faster_runner_up_is_faster(capsys, tmp_path):
    path = tmp_path / "t.msgpack"
    timing = Timing(median_ms=0.25, runner_up_ms=0.24875)  # winner kept by a tie-break
    save_table(Table([entry(64, timing=timing)]), path)
    code, out, _ = run(capsys, "show", path)
    assert code == 0 and "runner-up 0.5% faster" in out and "+-" not in out


def test_show_json_of_several_tables_is_refused_not_concatenated(capsys, tmp_path, table_path):
    code, out, err = run(capsys, "show", table_path, table_path, "--json")
    assert code == 2 and out == "" and "--json takes one TABLE" in err and len(err.splitlines()) == 1


def test_non_utf8_terminal_gets_escapes_and_json_stays_utf8(tmp_path):
    path = tmp_path / "u.msgpack"
    save_table(Table([entry(64, key=Key({"ключ": "é"}))]), path)
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONIOENCODING="ascii")

    def cli_bytes(*argv: object) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "megatron_tuning", *map(str, argv)],
            env=env,
            capture_output=True,
            timeout=120,
        )

    shown = cli_bytes("show", path)
    assert shown.returncode == 0 and b"Traceback" not in shown.stderr
    assert b"\\u043a" in shown.stdout and b"\\xb1" in shown.stdout  # key and the "±" escaped
    exported = cli_bytes("export", path)
    assert exported.returncode == 0 and b"Traceback" not in exported.stderr
    assert exported.stdout == Table.from_bytes(path.read_bytes()).to_json().encode("utf-8")
    assert cli_bytes("show", path, "--json").stdout == exported.stdout


@pytest.mark.parametrize("name", ["view.msgpack", "view.txt"])  # show would read either as msgpack
def test_export_refuses_an_output_name_other_than_json(capsys, tmp_path, table_path, name):
    target = tmp_path / name
    code, _, err = run(capsys, "export", table_path, target)
    assert code == 2 and "name it .json" in err and not target.exists()


def test_import_of_json_with_lone_surrogate_exits_2(capsys, tmp_path, table_path):
    view = tmp_path / "sur.json"
    view.write_text(Table([entry(64)]).to_json().replace('"a": "torch.float16"', '"a": "\\ud800"'))
    code, _, err = run(capsys, "import", view, tmp_path / "out.msgpack")
    assert code == 2 and "lone surrogate" in err and str(view) in err
    assert not (tmp_path / "out.msgpack").exists()


def test_export_import_round_trip_is_byte_identical(capsys, tmp_path, table_path):
    exported = tmp_path / "t.json"
    assert run(capsys, "export", table_path, exported)[0] == 0
    code, out, _ = run(capsys, "export", table_path)
    assert code == 0 and out == exported.read_text()
    back = tmp_path / "back.msgpack"
    assert run(capsys, "import", exported, back)[0] == 0
    assert back.read_bytes() == table_path.read_bytes()


def test_unwritable_output_exits_2(capsys, tmp_path, table_path):
    target = tmp_path / "missing-folder" / "t.json"
    code, _, err = run(capsys, "export", table_path, target)
    assert code == 2 and f"cannot write {target}" in err


def test_import_of_bad_json_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "megatron_tuning.table", "schema": 7}')
    code, out, err = run(capsys, "import", bad, tmp_path / "out.msgpack")
    assert code == 2 and "schema 7" in err and str(bad) in err
    assert not (tmp_path / "out.msgpack").exists()
    assert run(capsys, "import", tmp_path / "absent.json", tmp_path / "o.msgpack")[0] == 2


def test_import_refuses_a_json_output_name_and_oversized_input(capsys, tmp_path, table_path, monkeypatch):
    view = tmp_path / "t.json"
    assert run(capsys, "export", table_path, view)[0] == 0
    code, _, err = run(capsys, "import", view, tmp_path / "out.json")
    assert code == 2 and "name it .msgpack" in err and not (tmp_path / "out.json").exists()
    monkeypatch.setattr("megatron_tuning.tables.files.MAX_FILE_BYTES", 16)
    code, _, err = run(capsys, "import", view, tmp_path / "out.msgpack")
    assert code == 2 and "over the 16-byte limit" in err and str(view) in err


# -- diff --------------------------------------------------------------------------
def test_diff_exit_codes_and_output(capsys, tmp_path, table_path):
    assert run(capsys, "diff", table_path, table_path)[:2] == (
        0,
        f"--- {table_path}\n+++ {table_path}\nno differences\n",
    )
    other = tmp_path / "other.json"  # either format on either side
    changed = Table(
        [
            entry(64, timing=Timing(median_ms=0.3)),
            entry(256, key=ma(2)),
            entry(16, key=ma(3)),
        ]
    )
    save_table(changed, other)
    code, out, _ = run(capsys, "diff", table_path, other)
    assert code == 1
    assert "- sm80  pkg.other:gemm  [M=1 | a:torch.float16]" in out
    assert "+ sm90  pkg.kernels:matmul  [M=3 | a:torch.float16]  BLOCK=16" in out
    assert (
        "~ sm90  pkg.kernels:matmul  [M=2 | a:torch.float16]" in out
        and "config: BLOCK=128" in out
        and "-> BLOCK=256" in out
    )
    assert "1 added, 1 removed, 2 changed" in out
    code, out, _ = run(capsys, "diff", table_path, other, "--ignore-provenance", "--json")
    doc = json.loads(out)
    assert code == 1 and [c["key"] for c in doc["changed"]] == [ma(2)]  # the timing-only change is ignored
    assert run(capsys, "diff", table_path, tmp_path / "absent.msgpack")[0] == 2


# -- merge -------------------------------------------------------------------------
def _recordings(folder: Path) -> None:
    for rank, block in enumerate((64, 128, 64)):
        cfg = {"kwargs": {"BLOCK": block}, "num_warps": 4, "num_stages": 3}
        write_recording(
            [
                Decision(
                    kernel=KERNEL,
                    key=ma(1),
                    signature=config_signature(cfg),
                    source="recorded",
                    config=cfg,
                    arch="sm90",
                    rank=rank,
                )
            ],
            folder,
            rank=rank,
        )


def test_merge_writes_table_and_reports_disagreement(capsys, tmp_path):
    _recordings(tmp_path / "rec")
    out_path = tmp_path / "merged.msgpack"
    code, out, _ = run(capsys, "merge", out_path, tmp_path / "rec")
    assert code == 0
    assert "1 with disagreement" in out and "-> 2 vote(s)" in out and "recording-rank00001" in out
    assert load_table(out_path).get("sm90", KERNEL, ma(1)).votes == (2, 3)
    code, out, _ = run(capsys, "merge", out_path, tmp_path / "rec", "--json", "--strict")
    assert code == 1 and json.loads(out)["disagreements"][0]["votes"][0]["votes"] == 2
    bad = tmp_path / "rec" / "zz.msgpack"
    bad.write_bytes(b"junk")
    code, _, err = run(capsys, "merge", out_path, tmp_path / "rec")
    assert code == 2 and "zz.msgpack" in err


def test_merge_warns_about_inputs_from_different_kernel_sources(capsys, tmp_path):
    for name, digest in (("a", "aa"), ("b", "bb")):
        save_table(Table([entry(64, source_hash=digest * 32)]), tmp_path / f"{name}.msgpack")
    inputs = (tmp_path / "a.msgpack", tmp_path / "b.msgpack")
    code, out, _ = run(capsys, "merge", tmp_path / "out.msgpack", *inputs)
    assert code == 0 and "0 with disagreement" in out
    assert f"warning: sm90 {KERNEL} [M=1 | a:torch.float16] was recorded from different kernel sources" in out


def test_diff_and_merge_see_one_source_under_two_module_names_as_one_kernel(capsys, tmp_path):
    same, other = "ab" * 32, "cd" * 32
    a, b = tmp_path / "a.msgpack", tmp_path / "b.msgpack"
    save_table(Table([entry(64, kernel="mykernels:matmul", source_hash=same)]), a)
    rows = [entry(64, kernel="candidate:matmul", source_hash=same)]
    save_table(Table([*rows, entry(32, kernel="edited:matmul", source_hash=other)]), b)
    code, out, _ = run(capsys, "diff", a, b, "--json")
    doc = json.loads(out)
    assert code == 1 and [c["fields"] for c in doc["changed"]] == [
        {"kernel": ["mykernels:matmul", "candidate:matmul"]}
    ]
    assert [c["kernel"] for c in doc["added"]] == ["edited:matmul"] and doc["removed"] == []
    code, out, _ = run(capsys, "diff", a, b, "--json", "--ignore-provenance")
    assert json.loads(out)["changed"] == []  # a module name alone is no config change
    save_table(Table([entry(128, kernel="candidate:matmul", source_hash=same)]), b)
    third = tmp_path / "c.msgpack"
    save_table(Table([entry(64, kernel="third:matmul", source_hash=same)]), third)
    code, out, _ = run(capsys, "merge", tmp_path / "out.msgpack", a, b, third, "--json")
    (merged,) = load_table(tmp_path / "out.msgpack").entries()
    assert code == 0 and (merged.kernel, merged.config["kwargs"], merged.votes) == (
        "candidate:matmul",
        {"BLOCK": 64},
        (2, 3),
    )
    assert len(json.loads(out)["disagreements"]) == 1


def test_merge_into_a_folder_names_the_folder_not_a_temp_file(capsys, tmp_path):
    _recordings(tmp_path / "rec")
    code, _, err = run(capsys, "merge", tmp_path / "rec", tmp_path / "rec")
    assert code == 2 and f"cannot write {tmp_path / 'rec'}" in err and ".tmp" not in err
    assert not [p for p in (tmp_path / "rec").iterdir() if p.name.endswith(".tmp")]


# -- validate ----------------------------------------------------------------------
def _kernel_entry(**changes: object) -> Entry:
    fields: dict[str, object] = {
        "arch": "sm90",
        "kernel": kernel_id(sk.scale_add),
        "key": Key({"n": 8}, {"x_ptr": "torch.float32"}),
        "config": config_data(sk.ADD_CONFIGS[1]),
        "source_hash": kernel_source_hash(sk.scale_add),
        "triton_version": "3.6.0",
    }
    fields.update(changes)
    return Entry(**fields)  # type: ignore[arg-type]


def validate(capsys, tmp_path: Path, *entries: Entry, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    path = tmp_path / "v.msgpack"
    save_table(Table(entries), path)
    code, out, _ = run(
        capsys,
        "validate",
        path,
        "--arch",
        "sm90",
        "--triton-version",
        "3.6.0",
        "--import",
        "tests.support_kernels",
        *extra,
    )
    return code, out


def test_validate_clean_table(capsys, tmp_path):
    code, out = validate(capsys, tmp_path, _kernel_entry(), entry(64))  # foreign kernels: arch/version only
    assert code == 0 and "2 entries checked, 0 problem(s)" in out


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"source_hash": "00" * 32}, "kernel source changed"),
        ({"config": {"kwargs": {"BLOCK_SIZE": 24}, "num_warps": 4, "num_stages": 3}}, "none of the kernel's"),
        ({"kernel": "tests.support_kernels:gone"}, "no autotuned kernel"),
        ({"triton_version": "3.1.0"}, "installed is 3.6.0"),
        ({"arch": "sm80"}, "never applies here"),
    ],
)
def test_validate_finds_problems(capsys, tmp_path, changes, problem):
    code, out = validate(capsys, tmp_path, _kernel_entry(**changes))
    assert code == 1 and problem in out and "1 problem(s)" in out


def test_validate_pruning_kernels_accept_undeclared_configs_and_json_output(capsys, tmp_path):
    hooked = _kernel_entry(
        kernel=kernel_id(sk.copy_hooked),
        source_hash=kernel_source_hash(sk.copy_hooked),
        config={"kwargs": {"BLOCK_SIZE": 24}, "num_warps": 4, "num_stages": 3},
    )
    code, out = validate(capsys, tmp_path, hooked, extra=("--json",))
    assert code == 0 and json.loads(out)["problems"] == []


def test_validate_unimportable_module_is_bad_input_not_a_table_problem(capsys, tmp_path, table_path):
    # It was a "problem" row, exit 1: what validate says of a stale table, though no entry was checked.
    code, out, err = run(capsys, "validate", table_path, "--arch", "sm90", "--import", "no_such_module_xyz")
    assert (code, out) == (2, "")
    assert "--import no_such_module_xyz: no module named 'no_such_module_xyz'" in err and "PYTHONPATH" in err
    code, out, err = run(capsys, "validate", table_path, "--import", "no_such_module_xyz.kernels", "--json")
    assert (code, out) == (2, "") and "no module named 'no_such_module_xyz'" in err
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"")
    assert run(capsys, "validate", bad)[0] == 2


def test_validate_imports_a_candidate_file_by_path(capsys, tmp_path):
    path = tmp_path / "candidate_file.py"
    path.write_text(
        "import triton\n"
        "import triton.language as tl\n"
        "@triton.autotune(configs=[triton.Config({'B': 16}, num_warps=4, num_stages=3)], key=['n'])\n"
        "@triton.jit\n"
        "def k(x, n, B: tl.constexpr):\n"
        "    pass\n"
    )
    config = {"kwargs": {"B": 16}, "num_warps": 4, "num_stages": 3}
    rows = [Entry(arch="sm90", kernel=f"candidate_file:{k}", key=nx(1), config=config) for k in ("k", "gone")]
    table = tmp_path / "v.msgpack"
    save_table(Table(rows), table)
    code, out, _ = run(capsys, "validate", table, "--arch", "sm90", "--import", path)
    assert code == 1 and "1 problem(s)" in out and "no autotuned kernel candidate_file:gone" in out
    code, out, err = run(capsys, "validate", table, "--arch", "sm90", "--import", tmp_path / "absent.py")
    assert (code, out) == (2, "") and "absent.py: no such file" in err


def _package(root: Path, name: str, init: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(init)
    (root / name / "kernels.py").write_text(
        "import triton\n"
        "import triton.language as tl\n"
        "CONFIGS = [triton.Config({'B': 16}, num_warps=4, num_stages=3)]\n"
        "@triton.autotune(configs=CONFIGS, key=['n'])\n"
        "@triton.jit\n"
        "def k1(x, n, B: tl.constexpr):\n"
        "    pass\n"
        "@triton.autotune(configs=CONFIGS, key=['n'])\n"
        "@triton.jit\n"
        "def k2(x, n, B: tl.constexpr):\n"
        "    pass\n"
    )


def test_validate_scans_the_home_module_of_re_exported_kernels(capsys, tmp_path, monkeypatch):
    # `--import pkg` where pkg/__init__ re-exports only k1 of pkg.kernels used to report
    # pkg.kernels:k2 as "no autotuned kernel" although it is right there.
    _package(tmp_path, "reexport_pkg_a", "from reexport_pkg_a.kernels import k1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {"kwargs": {"B": 16}, "num_warps": 4, "num_stages": 3}
    entries = [
        Entry(arch="sm90", kernel=f"reexport_pkg_a.kernels:{k}", key=nx(1), config=config)
        for k in ("k1", "k2")
    ]
    path = tmp_path / "v.msgpack"
    save_table(Table([*entries, entry(64, kernel="reexport_pkg_a.kernels:gone")]), path)
    code, out, _ = run(capsys, "validate", path, "--arch", "sm90", "--import", "reexport_pkg_a")
    assert code == 1 and "1 problem(s)" in out and "reexport_pkg_a.kernels:gone" in out
    assert "reexport_pkg_a.kernels:k2" not in out


def test_validate_finds_class_attribute_kernels_and_skips_local_ones(capsys, tmp_path, monkeypatch):
    (tmp_path / "nested_kernels_b.py").write_text(
        "import triton\n"
        "import triton.language as tl\n"
        "CONFIGS = [triton.Config({'B': 16}, num_warps=4, num_stages=3)]\n"
        "class Ops:\n"
        "    @triton.autotune(configs=CONFIGS, key=['n'])\n"
        "    @triton.jit\n"
        "    def k(x, n, B: tl.constexpr):\n"
        "        pass\n"
        "def make():\n"
        "    @triton.autotune(configs=CONFIGS, key=['n'])\n"
        "    @triton.jit\n"
        "    def inner(x, n, B: tl.constexpr):\n"
        "        pass\n"
        "    return inner\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    good = {"kwargs": {"B": 16}, "num_warps": 4, "num_stages": 3}
    odd = {"kwargs": {"B": 99}, "num_warps": 4, "num_stages": 3}
    entries = [
        Entry(arch="sm90", kernel="nested_kernels_b:Ops.k", key=nx(1), config=good),
        Entry(arch="sm90", kernel="nested_kernels_b:Ops.k", key=nx(2), config=odd),
        Entry(arch="sm90", kernel="nested_kernels_b:make.<locals>.inner", key=nx(1), config=good),
    ]
    path = tmp_path / "v.msgpack"
    save_table(Table(entries), path)
    code, out, _ = run(capsys, "validate", path, "--arch", "sm90", "--import", "nested_kernels_b")
    assert code == 1 and "1 problem(s)" in out and "[n=2 | x:f]: config B=99" in out
    assert "no autotuned kernel" not in out


def test_validate_module_that_fails_at_import_is_bad_input_not_an_exit(
    capsys, tmp_path, monkeypatch, table_path
):
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "needs_a_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(capsys, "validate", table_path, "--arch", "sm90", "--import", "exits_at_import")
    assert (code, out) == (2, "") and "--import exits_at_import: importing it raised SystemExit(3)" in err
    # The module is there; what it imports is not: the fix is in the module, not the name given.
    code, out, err = run(capsys, "validate", table_path, "--import", "needs_a_dep")
    assert (code, out) == (2, "") and "--import needs_a_dep: importing it raised ModuleNotFoundError" in err
    assert "no_such_dependency_xyz" in err and "Fix the module" in err


# -- coverage ----------------------------------------------------------------------
def _log(path: Path, rank: int, rows: list[tuple[str, str, str, str | None]]) -> Path:
    decisions = [
        Decision(kernel=k, key=key, signature=sig, source=source, rank=rank, origin=origin, arch="sm90")
        for k, key, sig, source, origin in [
            (r[0], r[1], r[2], r[3], "t.msgpack" if r[3] == "table" else None) for r in rows
        ]
    ]
    write_decisions(path, decisions)
    return path


def test_coverage_per_rank_and_exit_codes(capsys, tmp_path):
    same = [("a:k", ma(1), "S1", "table"), ("a:k", ma(2), "S2", "cheapest"), ("b:k", "*", "", "out_of_scope")]
    r0 = _log(tmp_path / "d0.json", 0, same)
    r1 = _log(tmp_path / "d1.json", 1, same[:2])
    code, out, _ = run(capsys, "coverage", r0, r1)
    assert code == 0
    assert f"a:k  [{ma(1)}]  hit: all ranks  from t.msgpack" in out
    assert f"a:k  [{ma(2)}]  fallback: all ranks" in out
    assert "b:k  [*]  out_of_scope: rank(s) 0; absent: rank(s) 1" in out
    assert "hit 2, fallback 2, out_of_scope 1" in out
    assert run(capsys, "coverage", r0, r1, "--fail-on-fallback")[0] == 1
    r2 = _log(tmp_path / "d2.json", 2, [("a:k", ma(1), "S9", "cheapest")])
    code, out, _ = run(capsys, "coverage", r0, r1, r2, "--json")
    doc = json.loads(out)
    assert code == 1  # ranks launched different configs
    row = next(e for e in doc["entries"] if e["key"] == ma(1))
    assert row["diverged"] and row["ranks"]["2"] == {"status": "fallback", "signature": "S9", "origin": None}
    code, out, _ = run(capsys, "coverage", r0, r2)
    assert f"DIVERGED: a:k [{ma(1)}]" in out and "rank 2: S9 (fallback)" in out


def test_coverage_of_single_process_logs_keeps_files_apart(capsys, tmp_path):
    a = _log(tmp_path / "a.json", 0, [("a:k", ma(1), "S1", "table")])
    b = _log(tmp_path / "b.json", 0, [("a:k", ma(1), "S1", "table")])
    code, out, _ = run(capsys, "coverage", a, b, "--json")
    assert code == 0 and json.loads(out)["ranks"] == ["0@a.json", "0@b.json"]


def test_coverage_bad_input_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    code, _, err = run(capsys, "coverage", bad)
    assert code == 2 and "bad.json" in err
    assert run(capsys, "coverage", tmp_path / "absent.json")[0] == 2
    bad.write_text('{"format": "megatron_tuning.decisions", "decisions": [{"nope": 1}]}')
    assert run(capsys, "coverage", bad)[0] == 2
    table = tmp_path / "auto.msgpack"  # the auto cache, say: named as a table, with what to give instead
    save_table(Table([entry(64)]), table)
    code, _, err = run(capsys, "coverage", table)
    assert code == 2 and "a tuning table, not a decision log" in err and "--decision-log" in err


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"rank": [1]}, "rank must be an integer"),
        ({"kernel": ["a"]}, "kernel must be a string"),
        ({"source": ["table"]}, "source must be a string"),
        ({"key": 5}, "key must be a string"),
        ({"origin": {"f": 1}}, "origin must be a string"),
    ],
)
def test_coverage_wrong_typed_fields_exit_2_naming_the_row(capsys, tmp_path, row, problem):
    good = {"kernel": "a:k", "key": "M=1 | a:f", "signature": "S", "source": "table", "rank": 0}  # version 1
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"format": "megatron_tuning.decisions", "decisions": [good, dict(good, **row)]})
    )
    code, _, err = run(capsys, "coverage", bad)
    assert code == 2 and f"decision 1: {problem}" in err and str(bad) in err


def test_report_on_a_broken_decision_log_exits_2_naming_it(capsys, tmp_path):
    # `report` reads decision logs through the same reader as `coverage`: one clear error.
    bad = tmp_path / "log.json"
    bad.write_text('{"format": "megatron_tuning.decisions", "decisions": [{"nope": 1}]}')
    code, _, err = run(capsys, "report", bad)
    assert code == 2 and f"Decision log {bad}" in err and "Traceback" not in err


def test_coverage_absurdly_nested_json_exits_2(capsys, tmp_path):
    bad = tmp_path / "deep.json"
    bad.write_text("[" * 100_000)
    code, _, err = run(capsys, "coverage", bad)
    assert code == 2 and "RecursionError" in err and str(bad) in err


# -- one registration style ---------------------------------------------------------
def test_every_command_is_registered_one_way_and_listed(capsys):
    import importlib

    for name, (module, _) in cli.COMMANDS.items():
        loaded = importlib.import_module(f"megatron_tuning.commands.{module}")
        assert callable(getattr(loaded, f"add_{name}")) and callable(getattr(loaded, f"run_{name}")), name
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(f"    {name} " in out for name in cli.COMMANDS)


def test_table_commands_never_import_torch(tmp_path):
    table = tmp_path / "t.msgpack"
    save_table(Table([entry(64)]), table)
    code = (
        "import sys\nfrom megatron_tuning.commands import main\n"
        f"assert main(['show', {str(table)!r}]) == 0\nassert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_cache_prints_the_auto_cache_path_and_its_size(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = tmp_path / "xdg" / "megatron_tuning" / "sm90" / "auto.msgpack"
    assert run(capsys, "cache", "--arch", "sm90") == (0, f"{default}\t(not written yet)\n", "")
    table = tmp_path / "mine.msgpack"
    save_table(Table([entry(64)]), table)
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", str(table))
    assert run(capsys, "cache", "--arch", "sm90") == (0, f"{table}\t1 entries\n", "")
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", "off")
    code, out, _ = run(capsys, "cache")
    assert code == 0 and "off" in out
    with pytest.raises(SystemExit) as usage:  # a name, never a path out of the cache folder
        run(capsys, "cache", "--arch", "../../x")
    assert usage.value.code == 2 and "not an arch tag" in capsys.readouterr().err
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", str(tmp_path))  # a folder: auto would run without one
    code, out, _ = run(capsys, "cache")
    assert code == 2 and "not a file" in out and "not written yet" not in out


def test_show_and_export_read_a_cache_over_the_table_read_limit_on_request(tmp_path, monkeypatch, capsys):
    # An auto cache an older version let grow past the read limit: `show`/`export --max-size` read it.
    path = tmp_path / "auto.msgpack"
    save_table(Table([entry(64, key=ma(i)) for i in range(300)]), path)
    monkeypatch.setattr("megatron_tuning.tables.files.MAX_FILE_BYTES", path.stat().st_size // 2)
    code, _, err = run(capsys, "show", path)
    assert code == 2 and "--max-size 1" in err and str(path) in err
    code, out, _ = run(capsys, "show", path, "--max-size", "1")
    assert code == 0 and "300 of 300 entries" in out
    assert run(capsys, "export", path, tmp_path / "view.json", "--max-size", "1")[0] == 0
    assert len(load_table(tmp_path / "view.json", max_bytes=2**20)) == 300
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", str(path))
    code, _, err = run(capsys, "cache", "--arch", "sm90")
    assert code == 2 and "--max-size 1" in err and str(path) in err  # `cache` reads tables as they all do


@pytest.mark.parametrize("size", ["0", "-1", "1.5", "x", "65537"])
def test_a_bad_max_size_is_a_usage_error(table_path, capsys, size):
    with pytest.raises(SystemExit) as exc:
        cli.main(["show", str(table_path), "--max-size", size])
    assert exc.value.code == 2 and "MiB" in capsys.readouterr().err


def test_the_commands_in_docs_cache_md_parse():
    text = (REPO / "docs" / "cache.md").read_text(encoding="utf-8")
    commands = [line.split("python -m megatron_tuning ", 1)[1] for line in text.splitlines()
                if line.startswith("python -m megatron_tuning ")]  # fmt: skip
    assert len(commands) >= 5
    for command in commands:
        words = command.split("#", 1)[0].split()
        cli.build_parser(words).parse_args(words)


def test_cache_needs_only_the_cache_setting(tmp_path, monkeypatch, capsys):
    table = tmp_path / "mine.msgpack"
    save_table(Table([entry(64)]), table)
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", str(table))
    monkeypatch.setenv("MEGATRON_TUNING_SCOPE", "my-pkg")  # bad, but nothing `cache` uses
    monkeypatch.setenv("MEGATRON_TUNING_ON_MISS", "sometimes")
    assert run(capsys, "cache", "--arch", "sm90") == (0, f"{table}\t1 entries\n", "")


# -- control characters in human output ------------------------------------------
EVIL_KEY = Key({"M\r\x1b[2Kall good\u202e": 1})


def _assert_escaped(text: str) -> None:
    assert "\x1b" not in text and "\r" not in text and "\u202e" not in text
    assert "\\x1b[2K" in text and "\\x0d" in text and "\\u202e" in text


def test_show_diff_merge_escape_control_characters_and_json_stays_exact(capsys, tmp_path):
    evil = tmp_path / "evil.msgpack"
    save_table(Table([entry(64, key=EVIL_KEY, note="fine\x1b]0;title\x07")]), evil)
    plain = tmp_path / "plain.msgpack"
    save_table(Table([entry(32)]), plain)
    code, out, _ = run(capsys, "show", evil)
    assert code == 0
    _assert_escaped(out)
    assert "\x07" not in out and "\\x07" in out
    code, out, _ = run(capsys, "diff", plain, evil)
    assert code == 1
    _assert_escaped(out)
    code, out, _ = run(capsys, "merge", tmp_path / "m.msgpack", evil, plain)
    assert code == 0 and "\x1b" not in out
    code, out, _ = run(capsys, "show", evil, "--json")
    assert json.loads(out)["entries"][0]["key"] == EVIL_KEY.to_data()  # JSON output stays exact
    code, out, _ = run(capsys, "diff", plain, evil, "--json")
    assert json.loads(out)["added"][0]["key"] == EVIL_KEY


def test_coverage_and_report_escape_control_characters(capsys, tmp_path):
    log = tmp_path / "log.json"
    write_decisions(log, [Decision(kernel="m:k\x1b[31m", key=EVIL_KEY, signature="S\r", source="table")])
    code, out, _ = run(capsys, "coverage", log)
    assert code == 0 and "\x1b" not in out and "\r" not in out and "\\x1b[31m" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "megatron_tuning.decisions", "decisions": [{"kernel": "\x1b[2J"}]}))
    code, _, err = run(capsys, "coverage", bad)
    assert code == 2 and "\x1b" not in err


def test_validate_refuses_an_impossible_num_warps(capsys, tmp_path):
    # An entry with num_warps=-2**63 used to pass `validate`; the loader now refuses it, named.
    good = entry(64)
    data = (
        Table([good])
        .to_bytes()
        .replace(b"\xa9num_warps\x04", b"\xa9num_warps\xd3" + (2**63).to_bytes(8, "big"))
    )
    path = tmp_path / "t.msgpack"
    path.write_bytes(data)
    code, _, err = run(capsys, "validate", path, "--arch", "sm90")
    assert code == 2 and "num_warps=-9223372036854775808 is outside 1..1024" in err


# -- review and CI (issue 17 item 6) ----------------------------------------------
def test_show_the_review_json_and_coverage_list_keys_in_one_order_numbers_as_numbers(capsys, tmp_path):
    path = tmp_path / "t.msgpack"
    keys = [
        ma(100),
        ma(32),
        ma(4096),
        ma(8),
    ]
    ordered = [keys[3], keys[1], keys[0], keys[2]]
    save_table(Table([entry(64, key=k) for k in keys]), path)
    code, out, _ = run(capsys, "show", path)
    assert code == 0
    shown = [line.split("]")[0].strip(" [") for line in out.splitlines() if line.startswith("    [")]
    assert shown == ordered
    for view in ([], ["--no-provenance"]):
        assert run(capsys, "export", path, tmp_path / "view.json", *view)[0] == 0
        entries = json.loads((tmp_path / "view.json").read_text())["entries"]
        assert [Key.from_data(e["key"]) for e in entries] == ordered
    log = _log(tmp_path / "d0.json", 0, [(KERNEL, k, "S", "table") for k in keys])
    code, out, _ = run(capsys, "coverage", log, "--json")
    assert [e["key"] for e in json.loads(out)["entries"]] == ordered
    out = run(capsys, "coverage", log)[1]
    assert [
        line.split("[")[1].split("]")[0] for line in out.splitlines() if line.startswith(KERNEL)
    ] == ordered


@pytest.mark.parametrize("command", ["show", "validate"])
def test_an_unknown_config_field_is_an_error_naming_it_never_hidden(capsys, tmp_path, command):
    view = json.loads(Table([entry(64)]).to_json())
    view["entries"][0]["config"]["num_warp"] = 8  # a typo of num_warps
    path = tmp_path / "t.json"
    path.write_text(json.dumps(view))
    code, out, err = run(capsys, command, path)
    assert code == 2 and "BLOCK=64" not in out
    assert "unknown field(s) ['num_warp']" in err and "num_warps" in err and "config.kwargs" in err


def test_export_no_provenance_makes_a_retune_invisible_and_a_config_change_a_few_lines(capsys, tmp_path):
    import difflib

    keys = [ma(m) for m in (16, 32, 64, 128)]

    def tuned(blocks: dict[str, int], median: float, votes: tuple[int, int]) -> Path:
        path = tmp_path / f"t{len(list(tmp_path.iterdir()))}.msgpack"
        rows = [
            entry(blocks.get(k, 64), key=k, timing=Timing(median_ms=median, samples=10), votes=votes)
            for k in keys
        ]
        save_table(Table(rows), path)
        return path

    def review(path: Path) -> list[str]:
        code, out, _ = run(capsys, "export", path, "--no-provenance")
        assert code == 0
        return out.splitlines()

    before = tuned({}, 0.25, (2, 3))
    retuned = tuned({}, 0.31, (3, 3))  # timings and votes moved, every config the same
    changed = tuned({keys[2]: 128}, 0.29, (1, 3))  # one config changed, and all the churn
    full = [
        line
        for line in difflib.unified_diff(
            run(capsys, "export", before)[1].splitlines(), run(capsys, "export", changed)[1].splitlines(), n=0
        )
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
    ]
    assert review(before) == review(retuned)
    diff = [
        line
        for line in difflib.unified_diff(review(before), review(changed), n=0)
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
    ]
    assert diff == ['-     "BLOCK": 64', '+     "BLOCK": 128'] and len(full) > 4 * len(diff)
    assert '"timing"' not in "\n".join(review(before)) and '"votes"' not in "\n".join(review(before))


def test_a_review_view_of_the_auto_cache_imports_as_a_table_of_tuned_entries(capsys, tmp_path):
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.tables.cache import open_cache

    cache = open_cache(TuningPolicy(mode="auto", cache=str(tmp_path / "auto.msgpack")), "sm90")
    assert cache is not None
    config = {"kwargs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    key, hashed = ma(1), "ab" * 32
    tuned = Decision(KERNEL, key, "BLOCK=64", "tuned", config=config, arch="sm90", source_hash=hashed)
    assert cache.persist([tuned]) == 1
    view, committed = tmp_path / "review.json", tmp_path / "committed.msgpack"
    assert run(capsys, "export", cache.path, view, "--no-provenance")[0] == 0
    assert run(capsys, "import", view, committed)[0] == 0
    table = load_table(committed)
    assert [(e.how, e.source_hash) for e in table] == [("tuned", hashed)]  # was: how "hand"
    assert table.meta == {}  # was: kind=auto-cache, cache_format=1, on a table committed for review
    assert "auto-cache" not in run(capsys, "show", committed)[1]


def test_coverage_require_table_fails_on_a_nearest_entry_and_names_the_neighbour(capsys, tmp_path):
    hit = Decision(kernel="a:k", key=nx(1), signature="S1", source="table", origin="t.msgpack")
    near = Decision(
        kernel="a:k",
        key=nx(3),
        signature="S1",
        source="nearest",
        origin="t.msgpack",
        nearest_key=nx(4),
    )
    single = Decision(kernel="b:k", key=nx(1), signature="S", source="single")
    path = tmp_path / "d.json"
    write_decisions(path, [hit, near, single])
    code, out, err = run(capsys, "coverage", path, "--fail-on-fallback")
    assert code == 0  # no cheapest fallback: --fail-on-fallback lets the nearest entry through
    assert "a:k  [n=3 | x:f]  nearest: all ranks  from t.msgpack  using the entry for [n=4 | x:f]" in out
    code, out, err = run(capsys, "coverage", path, "--require-table")
    assert code == 1 and err == "not in the table: a:k  [n=3 | x:f]  (nearest)\n"
    code, out, _ = run(capsys, "coverage", path, "--json")
    row = next(e for e in json.loads(out)["entries"] if e["key"] == nx(3))
    assert row["ranks"]["0"]["nearest_key"] == nx(4)


def test_coverage_require_table_passes_when_every_shape_is_in_the_table(capsys, tmp_path):
    path = tmp_path / "d.json"
    write_decisions(
        path,
        [
            Decision(kernel="a:k", key=nx(1), signature="S1", source="table", origin="t.msgpack"),
            Decision(kernel="a:k", key=nx(2), signature="S1", source="override"),
            Decision(kernel="c:k", key="*", signature="", source="out_of_scope"),
        ],
    )
    code, _, err = run(capsys, "coverage", path, "--require-table")
    assert code == 0 and err == ""


def test_a_table_miss_error_is_one_message_without_a_traceback(capsys, monkeypatch, table_path):
    from megatron_tuning.core.errors import TableMissError

    def miss(args: object) -> int:
        raise TableMissError("pkg:k", nx(1), "no table entry")

    from megatron_tuning.commands import tables

    monkeypatch.setattr(tables, "run_show", miss)
    code, out, err = run(capsys, "show", table_path)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("megatron-tuning show: No tuned config for kernel pkg:k with key n=1 | x:f")
    assert "MEGATRON_TUNING_MODE=auto" in err and "ON_MISS=nearest" in err and "megatron_tuning tune" in err


def test_coverage_reports_each_source_apart_auto_included(tmp_path, capsys):
    sig = "BLOCK=64, num_warps=4, num_stages=3"
    logs = []
    for rank, first in ((0, "tuned"), (1, "adopted")):
        path = tmp_path / f"r{rank}.json"
        write_decisions(
            path,
            [
                Decision(kernel="k:a", key=nx(1), signature=sig, source=first, rank=rank),
                Decision(
                    kernel="k:a",
                    key=nx(3),
                    signature=sig,
                    source="nearest",
                    rank=rank,
                    origin="t.msgpack",
                ),
                Decision(kernel="k:a", key=nx(5), signature=sig, source="cheapest", rank=rank),
            ],
        )
        logs.append(path)
    code, out, _ = run(capsys, "coverage", *logs)
    assert code == 0
    assert "tuned: rank(s) 0; adopted: rank(s) 1" in out
    assert "Summary (kernel/key x rank): tuned 1, adopted 1, nearest 2, fallback 2" in out
    code, out, _ = run(capsys, "coverage", "--json", *logs)
    assert json.loads(out)["counts"] == {"adopted": 1, "fallback": 2, "nearest": 2, "tuned": 1}
