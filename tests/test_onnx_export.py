"""The drafter exported to ONNX and run on onnxruntime: the graph computes what torch (+ peft)
computes, adapters switch in one session, a rewind is a shorter past, the app demo runs without
torch, and a bad export or adapter is one clear line."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DRAFTER, TEST_HOME
from tiny_export import TAMPERS, tamper

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.drafter import Drafter
from omnidraft.drafter.onnx_lm import OnnxDraftLM, OrtCausalLM
from omnidraft.errors import OmnidraftError
from omnidraft.export.onnx_export import export_adapter, export_drafter

REPO = Path(__file__).resolve().parents[1]
TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a\n\nThe quick brown fox jumps over the lazy dog. ") * 3


@pytest.fixture(scope="module")
def drafter(real_models):
    model, tok = real_models(DRAFTER)
    return copy.deepcopy(model).float().eval(), tok


@pytest.fixture(scope="module")
def exports(drafter, real_models, tmp_path_factory):
    """fp32 and int8 exports of the real drafter, with the Qwen bridge."""
    from omnidraft.runtime import build_bridge

    model, tok = drafter
    t_model, t_tok = real_models("builtin:qwen2.5-coder-0.5b")
    bridges = {"qwen2.5-coder-0.5b": build_bridge(model, tok, t_model, t_tok)}
    root = tmp_path_factory.mktemp("exports")
    return {q: export_drafter(model, tok, root / q, quant=q, spec=DRAFTER, bridges=bridges) for q in ("fp32", "int8")}


def _peft(model, seed: int):
    """A LoRA adapter with small random B (peft's B starts at zero), as training would leave it."""
    from omnidraft.train import lora

    peft = lora.attach(copy.deepcopy(model), lora.lora_config(rank=4, alpha=8))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return peft, lora.lora_state(peft)


def _torch_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float().numpy()


@pytest.mark.real
def test_fp32_graph_matches_torch_with_no_adapter_then_two_adapters_in_one_session(drafter, exports):
    model, tok = drafter
    ids = tok.encode(TEXT)[:40]
    lm = OnnxDraftLM(exports["fp32"])
    checks = [(None, model)]
    for seed in (1, 2):
        peft, state = _peft(model, seed)
        checks.append(((state, 2.0), peft))  # alpha/rank = 8/4
    for adapter, reference in checks:
        lm.apply_adapter(*(adapter or (None,)))
        logits = lm.logits_for(ids[:30]).numpy()  # prefill
        assert np.abs(logits - _torch_logits(reference, ids[:30])).max() < 1e-3
        for n in range(30, 38):  # 8 cached one-token steps
            logits = lm.step(ids[n]).numpy()
            assert np.abs(logits - _torch_logits(reference, ids[: n + 1])).max() < 1e-3
    assert lm.last_hidden.shape == (lm.hidden_size,)


@pytest.mark.real
def test_the_int8_graph_takes_adapters_too(drafter, exports):
    """Quantization leaves the LoRA MatMuls in float and their inputs in the graph (the quantizer
    would otherwise bake the empty default in): an adapter moves the int8 drafter as it moves fp32."""
    import onnx

    model, tok = drafter
    graph = onnx.load(str(exports["int8"] / "model.onnx"), load_external_data=False)
    lora_inputs = {v.name for v in graph.graph.input if ".lora_" in v.name}
    assert len(lora_inputs) == 2 * len(json.loads((exports["int8"] / "manifest.json").read_text())["lora"])
    ids = tok.encode(TEXT)[:30]
    peft, state = _peft(model, 3)
    int8, fp32 = OnnxDraftLM(exports["int8"]), OnnxDraftLM(exports["fp32"])
    base = int8.logits_for(ids).numpy()
    for lm in (int8, fp32):
        lm.apply_adapter(state, 2.0)
    adapted, reference = int8.logits_for(ids).numpy(), fp32.logits_for(ids).numpy()
    moved = np.abs(adapted - base).max()
    assert moved > 0.05 and np.abs(adapted - reference).max() < moved  # it moved, and towards fp32 + adapter
    assert int(adapted.argmax()) == int(reference.argmax())
    assert int8.cheap_adapter_switch  # the weights choice alternates: back and forth costs no conversion
    feeds = int8.ort._lora
    int8.apply_adapter(None, keep_cache=True)
    int8.reset()
    assert np.array_equal(int8.logits_for(ids).numpy(), base)
    int8.apply_adapter(state, 2.0, keep_cache=True)
    assert all(int8.ort._lora[k] is v for k, v in feeds.items())  # the same inputs, not made again
    int8.reset()
    assert np.array_equal(int8.logits_for(ids).numpy(), adapted)
    int8.apply_adapter(state, 1.0)  # another scaling: other inputs
    assert not np.array_equal(int8.logits_for(ids).numpy(), adapted)


@pytest.mark.real
def test_a_rewind_is_a_shorter_past(exports, drafter):
    _, tok = drafter
    ids = tok.encode(TEXT)[:30]
    lm = OrtCausalLM(exports["fp32"])
    lm.logits_for(ids)
    rewound = lm.logits_for(ids[:20] + [ids[25]])  # keeps 20 positions, feeds one new token
    fresh = OrtCausalLM(exports["fp32"]).logits_for(ids[:20] + [ids[25]])
    assert len(lm.cached_ids) == 21 and np.abs(rewound - fresh).max() < 1e-4


@pytest.mark.real
def test_a_fork_has_the_same_weights_and_a_cache_of_its_own(exports, drafter):
    _, tok = drafter
    ids = tok.encode(TEXT)[:24]
    lm = OnnxDraftLM(exports["int8"])
    first = lm.logits_for(ids).numpy()
    twin = lm.fork()  # one per concurrent session (experiment capacity)
    assert twin.cached_ids == []
    assert np.array_equal(twin.logits_for(ids).numpy(), first)
    lm.step(ids[0])
    assert len(lm.cached_ids) == 25 and twin.cached_ids == ids


@pytest.mark.real
def test_int8_agrees_with_fp32_on_the_next_token(exports, drafter):
    _, tok = drafter
    ids = tok.encode(TEXT)[:160]
    fp32, int8 = OrtCausalLM(exports["fp32"]), OrtCausalLM(exports["int8"])
    agree = 0
    fp32.logits_for(ids[:10])
    int8.logits_for(ids[:10])
    for n in range(10, len(ids)):
        agree += int(fp32.step(ids[n]).argmax() == int8.step(ids[n]).argmax())
    rate = agree / (len(ids) - 10)
    print(f"int8 top-1 agreement with fp32 over {len(ids) - 10} positions: {rate:.3f}")
    assert rate >= 0.9
    assert json.loads((exports["int8"] / "manifest.json").read_text())["quant"] == "int8"


@pytest.mark.real
@pytest.mark.parametrize("quant", ["fp32", "int8"])
def test_greedy_output_with_the_onnx_drafter_is_the_targets(quant, exports, real_models):
    from omnidraft.runtime import build_bridge, make_drafter
    from omnidraft.target import TorchTarget

    t_model, t_tok = real_models("builtin:qwen2.5-coder-0.5b")
    d_model, d_tok = real_models(DRAFTER)
    target = TorchTarget(t_model, t_tok)
    bridge = build_bridge(d_model, d_tok, t_model, t_tok)
    stops = make_drafter(d_model, bridge, target).stop_ids
    decoder = SpeculativeDecoder(target, Drafter(OnnxDraftLM(exports[quant]), stops), bridge)
    config = DecodeConfig(max_new_tokens=32, draft_stop="confidence")
    for prompt in ("def is_prime(n):\n", "The three primary colours are"):
        ids = t_tok.encode(prompt)
        assert decoder.generate(ids, config).token_ids == SpeculativeDecoder(target).generate(ids, config).token_ids
        assert decoder.stats.drafted_tokens > 0


@pytest.mark.real
def test_adapters_export_as_onnx_adapter_files_and_activate_per_run(exports, drafter, tmp_path):
    from omnidraft.adapter import store
    from omnidraft.train.publish import save

    model, tok = drafter
    peft, _ = _peft(model, 3)
    identity = {"drafter_arch": store.architecture_fingerprint(model)}
    save(tmp_path / "pair", peft, {"identity": identity, "updates": 1})
    path = export_adapter(store.load(tmp_path / "pair", None), exports["fp32"], "pair")
    manifest = json.loads((exports["fp32"] / "manifest.json").read_text())
    assert manifest["adapters"]["pair"]["file"] == f"adapters/{path.name}"
    assert re.fullmatch(r"pair\.[0-9a-f]{16}\.onnx_adapter", path.name)  # named by content: see write_adapter
    ids = tok.encode(TEXT)[:24]
    lm = OrtCausalLM(exports["fp32"])
    lm.set_adapter_file(path)
    assert np.abs(lm.logits_for(ids) - _torch_logits(peft, ids)).max() < 1e-3
    lm.set_adapter_file(None)
    assert np.abs(lm.logits_for(ids) - _torch_logits(model, ids)).max() < 1e-3

    other = save(tmp_path / "other", peft, {"identity": {"drafter_arch": "0" * 16}})
    with pytest.raises(OmnidraftError, match="another drafter"):
        export_adapter(store.load(other.parent, None), exports["fp32"], "other")


@pytest.mark.real
def test_an_adapter_merged_at_export_gives_the_adapted_logits_and_takes_no_other(exports, drafter, tmp_path):
    from omnidraft.adapter import store
    from omnidraft.drafter.onnx_lm import OnnxDraftLM
    from omnidraft.train.publish import save

    model, tok = drafter
    peft, state = _peft(model, 5)
    save(tmp_path / "pair", peft, {"identity": {"drafter_arch": store.architecture_fingerprint(model)}, "updates": 1})
    loaded = store.load(tmp_path / "pair", None)
    merged = export_drafter(model, tok, tmp_path / "merged", quant="fp32", spec=DRAFTER, merged=loaded)
    manifest = json.loads((merged / "manifest.json").read_text())
    assert manifest["lora"] == {} and manifest["merged_adapter"]["version"] == loaded.version
    assert manifest["architecture"] == store.architecture_fingerprint(model)  # adapters' identity unchanged
    lm = OnnxDraftLM(merged)
    assert not any(".lora_" in i.name for i in lm.ort.session.get_inputs())  # no LoRA branches left
    ids = tok.encode(TEXT)[:24]
    adapted = _torch_logits(peft, ids)
    assert np.abs(lm.ort.logits_for(ids) - adapted).max() < 1e-3
    assert np.abs(lm.ort.logits_for(ids) - _torch_logits(model, ids)).max() > 1e-2  # the merge did something
    with pytest.raises(ValueError, match="merged into its weights"):
        lm.apply_adapter(state, 1.0)
    lm.apply_adapter(None)  # nothing to take off: still the merged weights
    assert np.abs(lm.ort.logits_for(ids) - adapted).max() < 1e-3
    with pytest.raises(OmnidraftError, match="merged into its weights"):
        export_adapter(loaded, merged, "pair")
    other = save(tmp_path / "other", peft, {"identity": {"drafter_arch": "0" * 16}})
    with pytest.raises(OmnidraftError, match="another drafter"):
        export_drafter(model, tok, tmp_path / "merged2", quant="fp32", spec=DRAFTER, merged=store.load(other.parent, None))


@pytest.mark.parametrize("argv, message", [
    (["--merge-adapter", "a--b", "--adapter", "all"], "give one of the two"),
    (["--merge-adapter", "no-such--pair"], "no trained adapter there"),
    (["--merge-adapter", "../escape"], "adapter"),
])
def test_export_merge_adapter_refuses_bad_requests_in_one_line(argv, message, tmp_path, monkeypatch, capsys):
    from omnidraft.cli import main

    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "export").exists()  # nothing written


@pytest.mark.real
def test_onnxruntime_genai_loads_the_export_and_its_adapters(exports, drafter, tmp_path):
    """An app on onnxruntime-genai (its Generator, its Adapters API) gets the drafter's logits, greedy
    tokens and rewinds from the folder as written, and the trained adapter's logits."""
    import onnxruntime_genai as og

    from omnidraft.adapter import store
    from omnidraft.train.publish import save

    model, tok = drafter
    ids = tok.encode(TEXT)[:24]
    og_model = og.Model(og.Config(str(exports["fp32"])))

    def generator(adapters=None, name=None):
        params = og.GeneratorParams(og_model)
        params.set_search_options(max_length=256)
        gen = og.Generator(og_model, params)
        if adapters is not None:
            gen.set_active_adapter(adapters, name)
        return gen

    def logits(gen) -> np.ndarray:
        return np.asarray(gen.get_logits())[0, -1]

    gen = generator()
    gen.append_tokens(np.asarray(ids, dtype=np.int32))
    assert np.abs(logits(gen) - _torch_logits(model, ids)).max() < 1e-3
    greedy = []
    for _ in range(6):
        greedy.append(int(logits(gen).argmax()))
        gen.append_tokens(np.asarray([greedy[-1]], dtype=np.int32))
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert greedy == expected
    gen.rewind_to(len(ids) + 2)  # a rejected draft: the cache drops its tail
    gen.append_tokens(np.asarray([greedy[2]], dtype=np.int32))
    assert np.abs(logits(gen) - _torch_logits(model, ids + greedy[:3])).max() < 1e-3

    peft, _ = _peft(model, 5)
    save(tmp_path / "pair", peft, {"identity": {"drafter_arch": store.architecture_fingerprint(model)}, "updates": 1})
    path = export_adapter(store.load(tmp_path / "pair", None), exports["fp32"], "genai-pair")
    adapters = og.Adapters(og_model)
    adapters.load(str(path), "genai-pair")
    gen = generator(adapters, "genai-pair")
    gen.append_tokens(np.asarray(ids, dtype=np.int32))
    adapted = _torch_logits(peft, ids)
    assert np.abs(logits(gen) - adapted).max() < 1e-3
    assert np.abs(adapted - _torch_logits(model, ids)).max() > 1e-2  # the adapter moved the logits


@pytest.mark.real
@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "def fibonacci(n):\n"])
def test_the_app_demo_runs_without_torch(exports, prompt):
    """The app demo drafts with onnxruntime, numpy and tokenizers alone; a prompt that ends in a bare
    line break (SmolLM2 spells a break and the next indent as one token) is healed: the draft's first
    token begins with the break, which the demo drops again before mapping to the target."""
    blocker = ("import sys\nclass Block:\n    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'transformers', 'omnidraft'):\n"
               "            raise ImportError(f'{name} is blocked: an app has no torch')\n"
               "sys.meta_path.insert(0, Block())\n"
               f"sys.argv = ['edge_drafter.py', {str(exports['int8'])!r}, {prompt!r}, '--k', '6']\n"
               f"exec(compile(open({str(REPO / 'demos' / 'edge_drafter.py')!r}).read(), 'edge_drafter.py', 'exec'))")
    proc = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "drafted 6 drafter tokens" in proc.stdout and "qwen2.5-coder-0.5b token ids" in proc.stdout
    healed = prompt.endswith("\n")
    assert ("healed" in proc.stdout) == healed
    if healed:
        assert "-> '\\n" in proc.stdout, proc.stdout  # the first drafted token spells the break again


def test_a_missing_truncated_or_foreign_export_is_one_line(tmp_path):
    with pytest.raises(OmnidraftError, match="not an omnidraft export"):
        OrtCausalLM(tmp_path)
    (tmp_path / "manifest.json").write_text('{"kind": "something-else"}')
    with pytest.raises(OmnidraftError, match="not an omnidraft export"):
        OrtCausalLM(tmp_path)
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(OmnidraftError, match="unreadable"):
        OrtCausalLM(tmp_path)


@pytest.mark.real
def test_cli_export_then_generate_drafts_through_onnxruntime(tmp_path, cli):
    """`export`, then `generate` drafting through the export (the CLI in this process, the session's models)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)
    run = lambda *a: cli(*a, home=home)  # noqa: E731
    exported = run("export", "--quant", "int8", "--target", "builtin:qwen2.5-coder-0.5b")
    assert exported.returncode == 0, exported.stderr[-2000:]
    folder = home / "export" / "smollm2-135m-int8"
    assert (folder / "bridge" / "qwen2.5-coder-0.5b" / "d2t.npy").is_file()
    args = ["generate", "--prompt", "def add(a, b):\n", "--max-new-tokens", "16", "--engine", "torch", "--json",
            "--draft-stop", "confidence", "--drafter-backend", "onnx"]
    onnx, alone = run(*args), run(*args, "--drafter", "none")
    assert onnx.returncode == 0, onnx.stderr
    assert json.loads(onnx.stdout)["token_ids"] == json.loads(alone.stdout)["token_ids"]
    assert json.loads(onnx.stdout)["stats"]["drafted_tokens"] > 0
    backends = run("models", "backends", "--json")  # auto weighs the export now that there is one
    assert backends.returncode == 0 and "onnx" in {m["backend"] for m in json.loads(backends.stdout)["measures"]}
    truncated = folder / "model.onnx.data"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    broken = run(*args)
    assert broken.returncode == 2 and "export again" in broken.stderr and "Traceback" not in broken.stderr


# ---------------------------------------------------------------- the manifest against the graph (issue 29 #3)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A real export of a tiny random drafter (the same exporter and layout as the real one)."""
    from tiny_export import build

    return build(tmp_path_factory.mktemp("tiny"), 1)


@pytest.mark.parametrize("how", TAMPERS)
def test_a_tampered_manifest_is_one_line_before_any_use(tiny_folder, tmp_path, how):
    import shutil

    folder = tmp_path / "export"
    shutil.copytree(tiny_folder, folder)
    OrtCausalLM(folder)  # untampered: loads
    manifest = json.loads((folder / "manifest.json").read_text())
    tamper(manifest, how)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(OmnidraftError) as err:
        OrtCausalLM(folder)
    message = str(err.value)
    assert "\n" not in message and "manifest" in message and "export again" in message


def test_fused_and_plain_attention_give_the_same_logits_through_reads_steps_and_a_rewind(tmp_path):
    """The default export has one ``GroupQueryAttention`` node per layer (rotary and the causal mask
    inside); ``attention="plain"`` spells the same in standard operators. Multi-row reads after a
    past (a chunked prompt, a verify-sized read), one-token steps and a rewind must agree."""
    import onnx
    from tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer(64)
    model = tiny_model(len(tok), seed=3)
    folders = {a: export_drafter(copy.deepcopy(model), tok, tmp_path / a, spec="tiny", attention=a)
               for a in ("fused", "plain")}
    for attention, folder in folders.items():
        ops = {node.op_type for node in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node}
        assert ("GroupQueryAttention" in ops) == (attention == "fused")
        assert json.loads((folder / "manifest.json").read_text())["attention"] == attention
    runs = {}
    for attention, folder in folders.items():
        lm, rows = OrtCausalLM(folder, threads=1), []
        ids = [(7 * i) % 60 + 2 for i in range(40)]
        rows.append(lm.logits_for(ids[:17]))  # a read from nothing
        rows.append(lm.logits_for(ids[:26]))  # 9 rows after a past of 17
        rows += [lm.step(t) for t in ids[26:30]]
        rows.append(lm.logits_for(ids[:21] + [5, 9]))  # a rewind, then 2 new rows
        runs[attention] = rows
    for fused, plain in zip(runs["fused"], runs["plain"]):
        assert np.abs(fused - plain).max() < 1e-4
    with torch.no_grad():  # and the plain graph is torch's model
        expected = model.float()(torch.tensor([ids[:21] + [5, 9]])).logits[0, -1].numpy()
    assert np.abs(runs["plain"][-1] - expected).max() < 1e-3
