"""Test setup: 8 simulated CPU devices for every test process (must precede jax import)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the suite and every CLI subprocess it starts:
# many tests compile the same tiny programs, and compiling dominates the suite's time.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(__import__("tempfile").gettempdir(), "ode_lm_test_xla_cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
# Test vectors from the paper's own implementation (copied from shared/reference; see its README).
# Not tests/data: gin resolves `include 'data/x.gin'` through importlib, and a tests/data folder
# on sys.path would be found as a namespace package named `data`.
REFERENCE_DIR = REPO / "tests" / "testdata" / "reference"


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO


@pytest.fixture(scope="session")
def reference_dir() -> pathlib.Path:
    """The paper-parity vectors ship with the tests, so parity never skips."""
    return REFERENCE_DIR
