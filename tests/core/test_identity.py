"""Kernel identity: autotuners over one function are told apart; one autotuner keeps ``module:qualname``."""

from __future__ import annotations

import importlib.util
import pickle
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import triton

from megatron_tuning.core.errors import AmbiguousConfigError
from megatron_tuning.core.identity import (
    DIGEST_CHARS,
    base_kernel_id,
    config_list_digest,
    config_signature,
    content_name,
    kernel_id,
    kernel_source_hash,
    shared_kernel_id,
    split_kernel_id,
)
from megatron_tuning.runtime.interception import lazy_benchmarker

from .. import support_kernels as sk


def test_one_autotuner_keeps_the_plain_id_that_todays_tables_use():
    for autotuner, name in ((sk.scale_add, "scale_add"), (sk.copy_hooked, "copy_hooked")):
        assert kernel_id(autotuner) == base_kernel_id(autotuner) == f"{sk.__name__}:{name}"
        assert split_kernel_id(kernel_id(autotuner)) == (sk.__name__, name, None)
    # Heuristics outside the autotuner: the module global is the wrapper, still one autotuner.
    assert kernel_id(sk.maybe_double) == f"{sk.__name__}:maybe_double"


def test_two_autotuners_over_one_function_are_two_kernels():
    small, large = kernel_id(sk.twin_small), kernel_id(sk.twin_large)
    assert small != large
    for autotuner, kernel in ((sk.twin_small, small), (sk.twin_large, large)):
        module, qualname, digest = split_kernel_id(kernel)
        assert (module, qualname) == (sk.__name__, "twin_body")
        assert digest == config_list_digest(autotuner) and len(digest) == DIGEST_CHARS
        assert base_kernel_id(autotuner) == f"{sk.__name__}:twin_body"
        assert content_name(kernel) == f"twin_body@{digest}"
    # One function, one source: the hash is shared; only the config lists differ.
    assert kernel_source_hash(sk.twin_small) == kernel_source_hash(sk.twin_large)


def test_the_shared_id_does_not_depend_on_the_plain_or_digest_choice():
    # kernel_id's choice reads the module's globals at the first launch, which can differ by rank.
    plain, digested = "pkg.ops:body", "pkg.ops:body@0123456789ab"
    assert shared_kernel_id(plain, "0123456789ab") == shared_kernel_id(digested, "0123456789ab")
    assert shared_kernel_id(plain, "0123456789ab") == "pkg.ops:body@0123456789ab"
    assert shared_kernel_id(plain, "ba9876543210") != shared_kernel_id(plain, "0123456789ab")
    assert shared_kernel_id(plain, None) == plain  # a decision without a digest keeps its id
    # With the source hash: the content identity, the same under any module name.
    assert shared_kernel_id(plain, "0123456789ab", "f" * 64) == shared_kernel_id(
        "candidate_1:body", "0123456789ab", "f" * 64
    )
    assert shared_kernel_id(plain, "0123456789ab", "f" * 64) != shared_kernel_id(
        plain, "0123456789ab", "e" * 64
    )


def test_config_list_digest_ignores_order_and_duplicates_but_not_content():
    def digest(configs: list[triton.Config]) -> str:
        return config_list_digest(triton.autotune(configs=configs, key=["n"])(sk.twin_body))

    with lazy_benchmarker():
        base = digest(sk.ADD_CONFIGS)
        assert digest(list(reversed(sk.ADD_CONFIGS))) == base
        assert digest(sk.ADD_CONFIGS + sk.ADD_CONFIGS[:2]) == base
        assert digest(sk.ADD_CONFIGS[:4]) != base
        changed = [triton.Config({"BLOCK_SIZE": 8}, num_warps=4)] + sk.ADD_CONFIGS[1:]
        assert digest(changed) != base
    assert sorted({config_signature(c) for c in sk.ADD_CONFIGS})  # the digest's input is the signatures


def test_configs_apart_only_in_a_function_sign_apart_and_so_do_their_lists():
    negate, double = (config_signature(c) for c in sk.ACT_CONFIGS)
    assert negate != double
    assert f"({sk.__name__}:negate)" in negate and "0x" not in negate  # no address: the same in every process
    with lazy_benchmarker():
        one, other = (triton.autotune(configs=[c], key=["n"])(sk.activate.fn) for c in sk.ACT_CONFIGS)
    assert config_list_digest(one) != config_list_digest(other)


class _Act:  # Python's default repr: an address, so only its type name signs
    def __call__(self, x: Any) -> Any:
        return x


def _scaled(factor: float) -> Any:
    def scale(x: Any) -> Any:
        return x * factor

    return scale


def _activate_over(*acts: Any) -> Any:
    with lazy_benchmarker():
        configs = [triton.Config({"BLOCK_SIZE": 16, "ACT": act}, num_warps=1) for act in acts]
        return triton.autotune(configs=configs, key=["n"])(sk.activate.fn)


@pytest.mark.parametrize(
    "acts",
    [(lambda x: -x, lambda x: x * 2), (_scaled(2.0), _scaled(3.0)), (_Act(), _Act())],
    ids=["lambdas", "factory-functions", "default-repr-objects"],
)
def test_configs_that_sign_alike_but_launch_differently_are_refused_naming_kernel_and_fix(acts):
    autotuner = _activate_over(*acts)
    signature = config_signature(autotuner.configs[0])
    assert config_signature(autotuner.configs[1]) == signature  # nothing in their text tells them apart
    with pytest.raises(AmbiguousConfigError) as info:
        config_list_digest(autotuner)
    message = str(info.value)
    assert f"Kernel {sk.__name__}:activate has two configs with the signature {signature!r}" in message
    assert "differ in ACT:" in message and "__repr__" in message and "its own name" in message
    assert str(pickle.loads(pickle.dumps(info.value))) == message  # crosses processes whole
    assert kernel_id(autotuner)  # naming it never refuses: an out-of-scope kernel is Triton's to pick


def _zero_out(nargs: dict[str, Any]) -> None:
    nargs["out_ptr"].zero_()


def _fill_out(nargs: dict[str, Any]) -> None:
    nargs["out_ptr"].fill_(1.0)


@pytest.mark.parametrize(
    "hooks", [(None, _zero_out), (_zero_out, _fill_out)], ids=["with-and-without", "two-hooks"]
)
def test_configs_apart_only_in_their_pre_hook_are_refused_naming_the_hook(hooks):
    # A signature leaves hooks out, so a rank adopting another's decision (or a table entry) by
    # signature could launch the first of them, without the hook the deciding rank ran.
    with lazy_benchmarker():
        configs = [triton.Config({"BLOCK_SIZE": 16}, num_warps=4, pre_hook=hook) for hook in hooks]
        autotuner = triton.autotune(configs=configs, key=["n"])(sk.twin_body)
    signature = config_signature(configs[0])
    assert config_signature(configs[1]) == signature
    with pytest.raises(AmbiguousConfigError) as info:
        config_list_digest(autotuner)
    message = str(info.value)
    assert info.value.fields == ["pre_hook"]
    assert f"Kernel {sk.__name__}:twin_body has two configs with the signature {signature!r}" in message
    assert "differ in pre_hook: a signature leaves hooks out" in message and "Keep one config" in message
    assert str(pickle.loads(pickle.dumps(info.value))) == message
    with lazy_benchmarker():  # one hook object on both: an equal duplicate, launching the same
        same = [triton.Config({"BLOCK_SIZE": 16}, num_warps=4, pre_hook=_zero_out) for _ in range(2)]
        assert config_list_digest(triton.autotune(configs=same, key=["n"])(sk.twin_body))


def _init_to(name: str, value: float = 0.0) -> Any:
    """A hook factory, as mamba_ssm's and Triton's tutorials' ``init_to_zero("C")``: a new closure
    per call."""

    def hook(nargs: dict[str, Any]) -> None:
        nargs[name].fill_(value)

    return hook


def test_factory_made_hooks_alike_are_one_hook_and_unlike_ones_are_refused():
    with lazy_benchmarker():

        def autotuner_with(*hooks: Any) -> Any:
            configs = [triton.Config({"BLOCK_SIZE": 16}, num_warps=4, pre_hook=hook) for hook in hooks]
            return triton.autotune(configs=configs, key=["n"])(sk.twin_body)

        alike = autotuner_with(_init_to("out_ptr"), _init_to("out_ptr"))
        assert config_list_digest(alike) == config_list_digest(autotuner_with(_init_to("out_ptr")))
        # Closed over apart, or other code: a hook of its own.
        for other in (_init_to("x_ptr"), _init_to("out_ptr", 1.0), _zero_out):
            with pytest.raises(AmbiguousConfigError) as info:
                config_list_digest(autotuner_with(_init_to("out_ptr"), other))
            assert info.value.fields == ["pre_hook"]


def test_equal_duplicate_configs_are_not_ambiguous():
    assert config_list_digest(_activate_over(sk.negate, sk.negate)) == config_list_digest(
        _activate_over(sk.negate)
    )
    relu = _scaled(1.0)
    assert config_list_digest(_activate_over(relu, relu))  # one object twice: either launches the same


def test_an_autotuner_made_outside_the_module_is_told_apart_from_the_modules_own():
    # The module's own autotuner sees no other in its module: its id (and its tables) stay.
    with lazy_benchmarker():
        local = triton.autotune(configs=sk.ADD_CONFIGS[:2], key=["n"])(sk.scale_add.fn)
    assert kernel_id(sk.scale_add) == f"{sk.__name__}:scale_add"
    assert kernel_id(local) == f"{sk.__name__}:scale_add@{config_list_digest(local)}"
    # Same config list as the module's autotuner: the same kernel, the same id.
    with lazy_benchmarker():
        same = triton.autotune(configs=list(sk.ADD_CONFIGS), key=["n"])(sk.scale_add.fn)
    assert kernel_id(same) == kernel_id(sk.scale_add)


_TWIN_FILE = """
import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK": b}) for b in (8, 16, 32, 64)]


@triton.jit
def body(x_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)


# torchao HQQ's shape: one heuristics wrapper, two autotuners over it, the jit function a global too.
_body = triton.heuristics({"EVEN": lambda args: args["n"] % 2 == 0})(body)
first = triton.autotune(configs=CONFIGS[:2], key=["n"])(_body)
second = triton.autotune(configs=CONFIGS[2:], key=["n"])(_body)
"""


def _load(path: Path, name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)  # never put in sys.modules, as eval pipelines do
    with lazy_benchmarker():
        spec.loader.exec_module(module)
    assert name not in sys.modules
    return module


def test_the_rule_is_a_function_of_the_code_not_of_the_module_name(tmp_path: Path):
    path = tmp_path / "twins.py"
    path.write_text(textwrap.dedent(_TWIN_FILE))
    a, b = _load(path, "mykernels_ident"), _load(path, "candidate_ident")
    ids_a = [kernel_id(a.first), kernel_id(a.second)]  # type: ignore[attr-defined]
    ids_b = [kernel_id(b.first), kernel_id(b.second)]  # type: ignore[attr-defined]
    assert ids_a[0] != ids_a[1] and all("@" in k for k in ids_a + ids_b)
    assert [content_name(k) for k in ids_a] == [content_name(k) for k in ids_b]
    assert [split_kernel_id(k)[0] for k in ids_b] == ["candidate_ident"] * 2
    assert kernel_source_hash(a.first) == kernel_source_hash(b.second)  # type: ignore[attr-defined]


_FACTORY_FILE = """
import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK": b}) for b in (8, 16, 32, 64)]


def make(configs, offset):
    @triton.autotune(configs=configs, key=["n"])
    @triton.jit
    def kernel(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + offset, mask=offsets < n)

    return kernel


small, large, shifted = make(CONFIGS[:2], 1), make(CONFIGS[2:], 1), make(CONFIGS[:2], 2)


@triton.jit
def body(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)


def build(configs):
    return triton.autotune(configs=configs, key=["n"])(body)
"""


def test_factory_kernels_and_autotuners_built_anywhere_get_distinct_stable_ids(tmp_path: Path):
    path = tmp_path / "factory.py"
    path.write_text(textwrap.dedent(_FACTORY_FILE))
    a, b = _load(path, "factory_a"), _load(path, "factory_b")

    def ids(module: Any) -> list[str]:
        with lazy_benchmarker():
            built = [module.build(module.CONFIGS[:2]), module.build(module.CONFIGS[2:])]
        return [kernel_id(k) for k in (module.small, module.large, module.shifted, *built)]

    ids_a, ids_b = ids(a), ids(b)
    assert len(set(ids_a)) == 5, ids_a  # configs, closed-over values and build sites tell them apart
    assert [content_name(k) for k in ids_a] == [content_name(k) for k in ids_b]  # stable across loads
