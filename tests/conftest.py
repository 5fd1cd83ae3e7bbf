"""Test-wide setup: which device the suite runs on, and the shared fixtures.

``--device cuda`` (or ``KVPLUS_TEST_DEVICE=cuda``) runs the suite with CUDA as torch's default device:
tensors the tests make without naming a device are CUDA tensors, so the Triton kernels run compiled
and the caches take their CUDA paths (side streams, events, pinned host memory). ``--device cpu`` runs
on the CPU, every Triton kernel under the interpreter. The default is CUDA where a CUDA device is
present, else the CPU. ``TRITON_INTERPRET`` set in the environment is left as it is.

`TRITON_INTERPRET` is read when `@triton.jit` decorates a kernel, so it is set in
``pytest_configure``, before any test module (and with it hf_kvplus) is imported.
"""

import os
import zlib

import pytest
import torch

DEVICE_ENV = "KVPLUS_TEST_DEVICE"


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=("cpu", "cuda"),
        default=os.environ.get(DEVICE_ENV) or None,
        help=f"device the tests run on (default: ${DEVICE_ENV}, else cuda when present, else cpu)",
    )


def pytest_configure(config):
    device = config.getoption("--device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda: torch sees no CUDA device")
        torch.set_default_device("cuda")
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        _share_cores_between_workers()
    config.kvplus_device = torch.device(device)


def _share_cores_between_workers() -> None:
    """Under pytest-xdist (`scripts/test.sh` runs one worker a core), each worker's torch gets its share of the
    cores: torch's default of one thread a core in every worker oversubscribes them and slows both. The share goes
    into the environment too, so that the processes a test starts (notebook kernels, the snippets, the CLI, the GPU
    pass's dry run) take it rather than every core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


#: The suite's longest tests (CI's `--durations` log, 20-210 s each on its 2-core VM), longest first. They run first
#: (`pytest_collection_modifyitems`), and `scripts/test.sh` runs the workers with `--dist worksteal`, so that an idle
#: worker takes tests from the busy one: the run ends on short tests, not one worker on a long test while the other
#: waits. A test missing here only runs in its usual place.
LONGEST_FIRST = (
    "test_gpu_pass.py::test_dry_run_of_the_whole_pass_on_the_cpu",
    "test_snippets.py::test_every_readme_and_docs_snippet_runs",
    "test_kernels_aot.py::test_covering_subset_compiles_for_sm90",
    "test_notebooks.py::test_notebook_runs",
    "test_compile_fullgraph.py::test_decode_step_compiles_as_one_graph[paged-quantized",
    "test_needle.py::test_smollm2_finds_the_needle",
    "test_resolve_models.py::test_real_smollm2_from_pypi",
    "test_compare_scripts.py::",
    "test_tensor_parallel.py::",
    "test_kernels_aot.py::test_fp8_attention_needs_sm89",
    "test_prefix_tiers.py::test_processes_",
    "test_plugin_isolation.py::test_dynamic_static_and_no_cache_are_bit_identical",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.nodeid.rpartition("/")[2]
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if name.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: every other test keeps its place


def pytest_report_header(config):
    import transformers

    interp = os.environ.get("TRITON_INTERPRET", "0")
    return (
        f"hf_kvplus test device: {config.kvplus_device} (TRITON_INTERPRET={interp}); "
        f"transformers {transformers.__version__} ({os.path.dirname(transformers.__file__)})"
    )


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    """The device the suite runs on (see the module docstring)."""
    return pytestconfig.kvplus_device


@pytest.fixture(scope="module")
def tiny_llama():
    """A 2-layer random Llama on the CPU (seed 0, vocabulary 96): the offloaded placement's tests decode with it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    with torch.device("cpu"):
        return LlamaForCausalLM(config).eval()


@pytest.fixture
def on_cpu():
    """For tests of what happens with CPU tensors (dispatch to the twins, the Triton path refusing them):
    tensors made without a device are CPU tensors inside the test, whatever device the suite runs on."""
    with torch.device("cpu"):
        yield


SEED_ENV = "KVPLUS_TEST_SEED"


@pytest.fixture
def seed(request) -> int:
    """The test's random seed, seeded into torch and returned: derived from the test's id, so a test draws the same
    numbers every run and on every worker, and each test different ones. `$KVPLUS_TEST_SEED` overrides it: a number,
    or `random` for a fresh seed each run. A failing test's report names its seed and how to rerun with it."""
    chosen = os.environ.get(SEED_ENV, "")
    if chosen == "random":
        s = int.from_bytes(os.urandom(4), "little")
    elif chosen:
        s = int(chosen)
    else:
        s = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(s)
    request.node.user_properties.append(("seed", s))
    return s


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(("seed", f"this test drew seed {value}: rerun it with {SEED_ENV}={value}"))
    return report


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every floating torch.empty made during the test starts as NaN, so unwritten output shows."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
