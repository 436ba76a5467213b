"""The skinny-GEMM Linear path computes the same products as F.linear, and only when enabled."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from tiny import tiny_pair

from omnidraft import fastlinear, kernels
from omnidraft.config import DecodeConfig
from omnidraft.errors import OmnidraftError


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 50, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


@pytest.mark.parametrize("rows", [1, 2, 5, 100])
def test_fast_paths_match_f_linear(rows):
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(1, rows, 16)
    expected = model(x)
    fastlinear.install(model, transposed_head=True)
    with fastlinear.enabled():
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.shape == expected.shape and got.is_contiguous()


def test_fast_path_is_scoped_to_enabled():
    model = fastlinear.install(Tiny(), transposed_head=True)
    calls = []
    weight = model.head.weight
    model.head._omnidraft_wt = torch.zeros(32, 50)  # make the fast path visible (a copy it takes as current)
    model.head._omnidraft_wt_key = (weight.data_ptr(), weight.dtype, weight._version)
    fastlinear._CHOICE[fastlinear._key((50, 32), 1, torch.float32, True)] = fastlinear._transposed  # as if it had timed fastest
    x = torch.randn(1, 1, 16)
    calls.append(bool(model(x).abs().sum() > 0))
    with fastlinear.enabled():
        calls.append(bool(model(x).abs().sum() > 0))
    calls.append(bool(model(x).abs().sum() > 0))
    assert calls == [True, False, True]


@pytest.mark.parametrize("rows", [1, 3])
def test_every_candidate_kernel_computes_f_linear_and_the_choice_is_kept(rows):
    torch.manual_seed(1)
    model = fastlinear.install(Tiny(), transposed_head=True)
    x = torch.randn(rows, 32)
    expected = torch.nn.functional.linear(x, model.head.weight)
    candidates = fastlinear._candidates(model.head, x, has_t=True)
    assert {fastlinear._f_linear, fastlinear._weights_first, fastlinear._transposed} <= set(candidates)
    assert (fastlinear._two_rows in candidates) == (rows == 1)
    assert (fastlinear._NATIVE[0] in candidates) == (kernels.linear_rows() is not None)
    for kernel in candidates:
        torch.testing.assert_close(kernel(model.head, model.head.weight, x), expected, rtol=1e-5, atol=1e-5)
        assert kernel(model.head, model.head.weight, x).shape == expected.shape
    chosen = fastlinear._choose(model.head, x)
    assert fastlinear._choose(model.head, x) is chosen is fastlinear._CHOICE[fastlinear._key((50, 32), rows, torch.float32, True)]


@pytest.mark.skipif(kernels.linear_rows() is None, reason="the native kernels are not built on this machine")
@pytest.mark.parametrize("rows", [17, 32, 33, 64])
def test_a_prompt_read_may_run_the_native_kernel_in_passes_with_each_rows_own_bits(rows):
    """Reads of 17-64 rows (a chat turn, a short prompt) may take the native kernel in passes of at
    most 16 rows: the product is F.linear's, and every row has the bits the kernel gives it alone,
    so a row's value does not depend on how many rows were read with it."""
    torch.manual_seed(2)
    layer = torch.nn.Linear(96, 40, bias=False)
    x = torch.randn(rows, 96)
    passes = [k for k in fastlinear._candidates(layer, x, has_t=False) if k.__name__.endswith("_passes")]
    assert len(passes) == len(fastlinear._native_kernels()) >= 1
    assert not any(k.__name__.endswith("_passes") for k in fastlinear._candidates(layer, x[:16], has_t=False))
    expected = torch.nn.functional.linear(x, layer.weight)
    for kernel, native in zip(passes, fastlinear._native_kernels()):
        got = kernel(layer, layer.weight, x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        alone = torch.cat([native(layer, layer.weight, x[i: i + 1]) for i in range(rows)])
        assert torch.equal(got, alone)


def test_choices_kept_before_the_candidates_changed_are_timed_again(tmp_path, monkeypatch):
    """A home's kernel choices from before a new candidate never timed it: they are not reused."""
    monkeypatch.setattr(fastlinear, "_CHOICE", {})
    monkeypatch.setattr(fastlinear, "_kept", {})
    path = tmp_path / "kernels.json"
    key = fastlinear._key_text(fastlinear._key((50, 32), 32, torch.float32, True))
    path.write_text(json.dumps({"machine": "cpu A", "choices": {key: "_f_linear"}}))  # as an older version wrote it
    fastlinear.keep_choices_at(path, "cpu A")
    assert fastlinear._CHOICE == {}
    path.write_text(json.dumps({"machine": f"cpu A; candidates {fastlinear.CANDIDATES}", "choices": {key: "_f_linear"}}))
    fastlinear.keep_choices_at(path, "cpu A")
    assert list(fastlinear._CHOICE.values()) == [fastlinear._f_linear]


def test_kernel_choices_are_kept_per_machine_for_the_next_process(tmp_path, monkeypatch):
    """A one-shot CLI run would otherwise time every (shape, rows) again on its first requests."""
    monkeypatch.setattr(fastlinear, "_CHOICE", {})
    monkeypatch.setattr(fastlinear, "_kept", {})
    path = tmp_path / "costs" / "kernels.json"
    fastlinear.keep_choices_at(path, "cpu A")
    model = fastlinear.install(Tiny(), transposed_head=True)
    chosen = fastlinear._choose(model.head, torch.randn(3, 32))
    assert path.is_file()
    timed = []
    monkeypatch.setattr(fastlinear, "_candidates", lambda *a: timed.append(a) or [fastlinear._f_linear])
    for machine, reused in (("cpu A", True), ("cpu B", False)):  # another CPU's choice is timed again
        fastlinear._CHOICE.clear()
        fastlinear.keep_choices_at(path, machine)
        got = fastlinear._choose(model.head, torch.randn(3, 32))
        assert (got is chosen and not timed) if reused else (got is fastlinear._f_linear and len(timed) == 1)
    path.write_text("{not json")  # damaged: ignored, timed again, rewritten
    fastlinear._CHOICE.clear()
    fastlinear.keep_choices_at(path, "cpu B")
    fastlinear._choose(model.head, torch.randn(3, 32))
    assert len(timed) == 2 and "cpu B" in path.read_text()


def test_a_choice_is_per_thread_count_and_both_are_kept(tmp_path, monkeypatch):
    """A server pinned to one core must not reuse the kernels a two-thread run timed fastest."""
    monkeypatch.setattr(fastlinear, "_CHOICE", {})
    monkeypatch.setattr(fastlinear, "_kept", {})
    path = tmp_path / "kernels.json"
    fastlinear.keep_choices_at(path, "cpu A")
    model = fastlinear.install(Tiny(), transposed_head=True)
    picks = {1: fastlinear._f_linear, 2: fastlinear._weights_first}
    before = torch.get_num_threads()
    try:
        for threads, kernel in picks.items():
            torch.set_num_threads(threads)
            monkeypatch.setattr(fastlinear, "_candidates", lambda *a, k=kernel: [k])
            assert fastlinear._choose(model.head, torch.randn(3, 32)) is kernel
        fastlinear._CHOICE.clear()
        fastlinear.keep_choices_at(path, "cpu A")  # the next process: both come back, each for its threads
        monkeypatch.setattr(fastlinear, "_candidates", lambda *a: pytest.fail("timed again"))
        for threads, kernel in picks.items():
            torch.set_num_threads(threads)
            assert fastlinear._choose(model.head, torch.randn(3, 32)) is kernel
    finally:
        torch.set_num_threads(before)


def test_the_transposed_copy_follows_a_changed_weight():
    """A model converted to bf16 after install (a shared drafter copied at another dtype), or whose
    weights an adapter merge changed in place, must not compute with the old transposed copy."""
    torch.manual_seed(2)
    model = fastlinear.install(Tiny(), transposed_head=True)
    x = torch.randn(1, 32)
    torch.testing.assert_close(fastlinear._transposed(model.head, model.head.weight, x), torch.nn.functional.linear(x, model.head.weight))
    with torch.no_grad():
        model.head.weight.add_(1.0)  # an in-place merge
    torch.testing.assert_close(fastlinear._transposed(model.head, model.head.weight, x), torch.nn.functional.linear(x, model.head.weight))
    model.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    got = fastlinear._transposed(model.head, model.head.weight, xb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch.nn.functional.linear(xb, model.head.weight), rtol=2e-2, atol=2e-2)
    with fastlinear.enabled():  # the whole path, timing and all, at the new dtype
        assert model(torch.randn(1, 1, 16).to(torch.bfloat16)).dtype == torch.bfloat16


def test_translate_option_is_validated():
    from omnidraft.verify import rule_info

    assert rule_info("greedy").translations[0] == "text"  # what --translate auto picks
    assert rule_info("omnidraft").translations == ("tokens",)
    with pytest.raises(OmnidraftError):
        DecodeConfig(verify="tli", temperature=0.5, translate="text").validate()
    with pytest.raises(OmnidraftError):
        DecodeConfig(translate="bytes").validate()


def test_a_warm_up_chooses_the_kernels_of_every_verify_length_and_leaves_the_cache_empty():
    """A server times its kernels before clients share its cores; afterwards decoding is unchanged."""
    _, target, _ = tiny_pair()
    prompt = target.tokenizer.encode("the cat sat on")
    before = target.score(prompt, 0)
    target.reset()
    fastlinear._CHOICE.clear()
    target.warm_up(5)
    rows_chosen = {key[2] for key in fastlinear._CHOICE}
    assert set(range(1, 7)) <= rows_chosen  # 0..5 proposals: 1..6 rows, plus the 4-token prefix
    assert target.lm.cached_ids == []
    torch.testing.assert_close(target.score(prompt, 0), before, rtol=1e-5, atol=1e-5)


def test_the_native_kernel_is_built_where_the_cpu_can_run_it():
    """Set-up builds it (python -m omnidraft.kernels); a machine with AVX2 and a compiler that runs
    without it has lost the fast verify path silently."""
    if kernels.unsupported_reason() is None and shutil.which("c++"):
        assert kernels.linear_rows() is not None, f"no build under {kernels.build_dir()}"
    elif kernels.unsupported_reason() is not None:
        assert kernels.linear_rows() is None


@pytest.mark.parametrize("tiled", [True, False])
def test_the_native_kernel_gives_a_row_the_same_bits_whatever_the_row_count(tiled):
    linear_rows = kernels.linear_rows()
    if linear_rows is None:
        assert kernels.unsupported_reason() is not None
        return
    torch.manual_seed(3)
    w, x = torch.randn(300, 901), torch.randn(19, 901)  # 901: a scalar tail after the 8-wide lanes
    together = linear_rows(x, w, tiled)
    torch.testing.assert_close(together, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    assert torch.equal(together, linear_rows(x, w, not tiled))
    for i in range(19):
        assert torch.equal(linear_rows(x[i:i + 1].contiguous(), w, tiled), together[i:i + 1])


def test_the_avx512_kernel_is_built_where_the_cpu_has_avx512_and_only_there():
    if kernels.unsupported_reason("skinny512") is None and shutil.which("c++"):
        assert kernels.linear_rows_512() is not None, f"no build under {kernels.build_dir('skinny512')}"
        assert fastlinear._native_512 in fastlinear._native_kernels()
    elif kernels.unsupported_reason("skinny512") is not None:
        assert kernels.linear_rows_512() is None and fastlinear._native_512 not in fastlinear._native_kernels()


@pytest.mark.parametrize("n_in", [896, 904, 901])  # whole 16s; an 8-input remainder; 8s and a scalar tail
def test_the_avx512_kernel_gives_the_avx2_kernels_bits_for_every_row_count(n_in):
    """fastlinear may pick it for one row count and the AVX2 kernel for another: a verify must still
    compute exactly what plain steps would, so the two must agree bit for bit."""
    fast, base = kernels.linear_rows_512(), kernels.linear_rows()
    if fast is None or base is None:
        assert kernels.unsupported_reason("skinny512") is not None or base is None
        return
    torch.manual_seed(4)
    w, x = torch.randn(301, n_in), torch.randn(19, n_in)  # 301 outputs: tiles of 4 and 8 and a remainder
    expected = base(x, w, True)
    for rows in range(1, 20):
        assert torch.equal(fast(x[:rows].contiguous(), w), expected[:rows]), rows


def test_a_kernels_build_tag_covers_the_headers_it_includes():
    """A change to skinny_common.h must make a new build, or a machine keeps running the old one."""
    header = (Path(kernels.__file__).parent / "skinny_common.h").read_bytes()
    for name in ("skinny", "skinny512"):
        assert header in kernels._source_bytes(kernels.EXTENSIONS[name][0])


def test_prompt_reads_share_row_classes_and_verifies_keep_their_own():
    """A chat's turns read prompts of every length up to 64 rows: each length timing its own kernels
    cost a turn ~1-2 s; verifies (up to the native kernel's 16 rows) keep a choice per count."""
    assert [fastlinear.rows_class(r) for r in (1, 2, 16)] == [1, 2, 16]
    assert {fastlinear.rows_class(r) for r in range(17, 33)} == {32}
    assert {fastlinear.rows_class(r) for r in range(33, fastlinear.SKINNY_MAX_ROWS + 1)} == {fastlinear.SKINNY_MAX_ROWS}
    assert fastlinear._key((50, 32), 20, torch.float32, False) == fastlinear._key((50, 32), 31, torch.float32, False)


def test_prepare_times_every_row_class_once_so_forwards_time_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(fastlinear, "_CHOICE", {})
    monkeypatch.setattr(fastlinear, "_kept", {})
    fastlinear.keep_choices_at(tmp_path / "kernels.json", "cpu A")
    model = fastlinear.install(Tiny(), transposed_head=True)
    rows = [1, 2, 3, 20, 40]
    assert len(fastlinear.untimed(model, rows)) == 2 * 5  # two shapes, five classes
    assert fastlinear.prepare(model, rows) == 10 and fastlinear.untimed(model, rows) == []
    assert len(json.loads((tmp_path / "kernels.json").read_text())["choices"]) == 10
    assert fastlinear.prepare(model, rows) == 0
    monkeypatch.setattr(fastlinear, "_time_candidates", lambda *a: pytest.fail("timed during a forward"))
    with fastlinear.enabled(), torch.inference_mode():  # as the engine runs them (the transposed copies
        for r in (1, 2, 3, 17, 25, 33, 64):  # are inference tensors); 17..64: the prompt classes 20 and 40 stood for
            model(torch.randn(1, r, 16))


def test_a_weight_larger_than_the_cold_size_is_timed_on_its_leading_rows(monkeypatch):
    """Gemma 3's 671 MB LM head, timed whole for every row count, made a warm-up take ~40 s."""
    monkeypatch.setattr(fastlinear, "_COLD_BYTES", 50 * 2**20)
    layer = torch.nn.Linear(1024, 64 * 1024, bias=False)  # 256 MiB
    (view,) = fastlinear._timing_weights(layer, has_t=False)
    assert view.shape == (50 * 256, 1024) and view.data_ptr() == layer.weight.data_ptr() and view.is_contiguous()
    medium = torch.nn.Linear(1024, 8 * 1024, bias=False)  # 32 MiB: more than half the cold size, its own copy
    assert fastlinear._timing_weights(medium, has_t=False)[0] is medium.weight
    small = fastlinear._timing_weights(torch.nn.Linear(1024, 1024, bias=False), has_t=False)  # 4 MiB: copies
    assert len(small) == 13 and all(w.shape == (1024, 1024) for w in small)


def test_a_clear_loser_is_timed_in_the_first_round_only(monkeypatch):
    calls = {"fast": 0, "slow": 0}

    def kernel(name, seconds):
        def run(layer, weight, flat):
            calls[name] += 1
            time.sleep(seconds)
            return flat
        run.__name__ = name
        return run

    fast, slow = kernel("fast", 0.001), kernel("slow", 0.02)
    monkeypatch.setattr(fastlinear, "_candidates", lambda *a: [slow, fast])
    layer = torch.nn.Linear(8, 8)
    assert fastlinear._time_candidates(layer, torch.randn(2, 8), False, [layer.weight]) is fast
    assert calls == {"fast": 4, "slow": 2}  # warm-up and round 1; fast: all three rounds
