"""batchgen's own decoder (pipeline/model/decoder.py) against transformers' model code: which models it
takes, its logits, and the engine's greedy output on it against plain uncached `generate`."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.jobsets import edge_case_requests, tokenizer
from batchgen.pipeline.model import decoder_config
from batchgen.pipeline.model.decoder import Decoder
from batchgen.pipeline.model.hf import as_forward
from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.model.kv import PrefixKV
from batchgen.pipeline.model.load import load_config, load_model
from batchgen.pipeline.run.preflight import context_window, vocab_size
from batchgen.pipeline.model.step import Segment, build
from tests.helpers.reference import reference_generate
from tests.helpers.reference import bf16_tie
from tests.helpers.tiny_models import ARCHS, EXTRA, make_decoder, make_model

EOS = [2]
TAKES = ["llama", "qwen2", "mistral", "qwen3", "llama_bias"]  # mistral: a sliding window of 12


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.mark.parametrize("arch", ARCHS + list(EXTRA))
def test_which_models_it_takes(arch, tmp_path):
    make_model(arch).save_pretrained(tmp_path)
    config, why = decoder_config.read(tmp_path)
    if arch in TAKES or arch == "llama_head32":  # heads of 32: the anchor kernels' tests (test_native)
        assert why is None and config.num_hidden_layers == 2
        assert config.layer_windows == ((12, 12) if arch == "mistral" else (None, None))
    else:
        assert config is None and "model type" in why


def _edit(tmp_path, **changes):
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    for k, v in changes.items():
        if v is _DROP:
            raw.pop(k)
        else:
            raw[k] = v
    path.write_text(json.dumps(raw))


_DROP = object()


@pytest.mark.parametrize("arch, changes, why", [
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "rope parameters lack low_freq_factor"),  # transformers refuses it too
    ("llama", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "rope type 'proportional'"),
    ("llama", {"logits_scaling": 2.0}, "config.json has logits_scaling, which the decoder does not read"),
    ("llama", {"rms_norm_eps": _DROP}, "does not state rms_norm_eps"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ("llama", {"auto_map": {"AutoModelForCausalLM": "x.Y"}}, "auto_map"),
    ("llama", {"tie_word_embeddings": True}, "holds lm_head.weight"),  # would not read its own head
    ("llama", {"attention_bias": True}, "lacks model.layers.0.self_attn.k_proj.bias"),
    ("qwen2", {"use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]},
     "sliding layers without a sliding window"),  # saved with sliding_window null: transformers' mask fails
    ("mistral", {"sliding_window": _DROP}, "does not state sliding_window"),
])
def test_what_it_refuses(arch, changes, why, tmp_path):
    """Anything its forward does not implement, or a value left to a config class's default, goes
    to transformers' model code."""
    make_model(arch).save_pretrained(tmp_path)
    _edit(tmp_path, **changes)
    config, reason = decoder_config.read(tmp_path)
    assert config is None and why in reason, reason


def test_it_refuses_a_checkpoint_with_tensors_it_would_not_use(tmp_path):
    make_model("llama").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert "holds model.layers.0.self_attn.extra.weight" in decoder_config.read(tmp_path)[1]


def test_it_refuses_a_checkpoint_with_integer_weights(tmp_path):
    """A weight stored as integers (quantized without a quantization config): transformers decides."""
    make_model("llama").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int8)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert decoder_config.read(tmp_path)[1] == "its checkpoint stores model.norm.weight as I8, not a floating-point type"


@pytest.mark.parametrize("arch", TAKES)
def test_logits_equal_transformers_forward(arch, tmp_path):
    """One 40-token sequence prefilled from scratch: every position's logits against the model's
    own full forward (float32)."""
    model, dec = make_decoder(arch, tmp_path)
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = PrefixKV(dec.layer_shapes(), len(ids), torch.float32, torch.device("cpu"))
    step = build([], [], [(Segment(0, 0, kv.k, kv.v, 0, 0, 0), ids)], None, torch.device("cpu"))
    with torch.inference_mode():
        got = dec.forward(step, torch.arange(len(ids)))
        want = model(torch.tensor([ids])).logits[0]
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("kernels", ["compiled", "pytorch"])
@pytest.mark.parametrize("arch", TAKES)
def test_greedy_equals_uncached_generate(arch, kernels, tok, tmp_path, monkeypatch):
    """The engine on the decoder: every edge case (prompt == shared prefix, one-token prompts, n
    samples, nested prefixes, rows joining) equals transformers' uncached `generate`."""
    if kernels == "pytorch":
        monkeypatch.setenv("BATCHGEN_NATIVE", "0")
    model, dec = make_decoder(arch, tmp_path)
    reqs = edge_case_requests(tok)
    engine = Engine(dec, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=250)
    got = {(c.key, c.sample_index): c.token_ids for c in engine.run(reqs)}
    assert engine.model.model_code == "batchgen" and engine.stats.own_decoder_forwards > 0 and engine.stats.transformers_forwards == 0
    assert engine.stats.cascade_batches > 0 and engine.stats.admitted_rows > 3
    for r in reqs:
        want = reference_generate(model, r, EOS)
        assert all(got[(r.key, s)] == want for s in range(r.params.n)), f"{arch}: job {r.key}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama_head32"])
def test_bfloat16_greedy_equals_bfloat16_uncached_generate(arch, tok, tmp_path):
    """As test_engine's bfloat16 test: equal, or parting exactly where the reference's own
    bfloat16 logits are tied. llama_head32: head size 32, so prefill and decode's anchors run on
    AMX tiles where the CPU has them."""
    model, dec = make_decoder(arch, tmp_path, dtype=torch.bfloat16)
    reqs = edge_case_requests(tok)
    engine = Engine(dec, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=250)
    got = {(c.key, c.sample_index): c.token_ids for c in engine.run(reqs)}
    equal = 0
    for r in reqs:
        want = reference_generate(model, r, EOS)
        for s in range(r.params.n):
            equal += got[(r.key, s)] == want
            assert got[(r.key, s)] == want or bf16_tie(model, r.prompt_ids, want, got[(r.key, s)]), f"{arch}: {r.key}"
    assert equal >= len(got) * 2 // 3


def test_load_model_picks_the_decoder_on_a_cpu(tmp_path, monkeypatch):
    make_model("llama").save_pretrained(tmp_path / "llama")
    make_model("gpt2").save_pretrained(tmp_path / "gpt2")
    model, _ = load_model(str(tmp_path / "llama"), "cpu", "float32")
    assert isinstance(model, Decoder) and model.dtype == torch.float32
    assert load_model(str(tmp_path / "llama"), "cpu", "bfloat16")[0].dtype == torch.bfloat16
    assert not isinstance(load_model(str(tmp_path / "llama"), "cpu", own_decoder=False)[0], Decoder)
    assert not isinstance(load_model(str(tmp_path / "gpt2"), "cpu")[0], Decoder)  # not a model it takes
    monkeypatch.setenv("BATCHGEN_DECODER", "0")
    assert not isinstance(load_model(str(tmp_path / "llama"), "cpu")[0], Decoder)


@pytest.mark.parametrize("arch", TAKES)
def test_its_config_reads_as_transformers_does(arch, tmp_path):
    """What the checks before a run read of a model (context window, vocabulary, end-of-sequence
    ids) equals what transformers' config and generation config say."""
    from transformers import AutoConfig

    model = make_model(arch)
    model.generation_config.eos_token_id = [2, 5]
    model.save_pretrained(tmp_path)
    ours, theirs = load_config(str(tmp_path)), AutoConfig.from_pretrained(tmp_path)
    assert isinstance(ours, decoder_config.DecoderConfig)
    assert (context_window(ours), vocab_size(ours)) == (context_window(theirs), vocab_size(theirs))
    hf = load_model(str(tmp_path), "cpu", own_decoder=False)[0]
    assert load_model(str(tmp_path), "cpu")[0].eos_token_ids == as_forward(hf).eos_token_ids == [2, 5]


def test_tokenizer_without_the_config_class_is_the_same(model_dir):
    """`Tokenizer.load` hands AutoTokenizer the few config fields it reads instead of the config
    class (whose import costs a second): the same tokenizer class, ids and chat text."""
    from transformers import AutoTokenizer

    from batchgen.pipeline.text.tokenize import Tokenizer, _config_for_tokenizer

    assert _config_for_tokenizer(str(model_dir))  # the fast path applies to this directory
    ours, theirs = Tokenizer.load(str(model_dir)).hf, AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(theirs)
    for text in ("the answer", "<|im_start|>user\nhi<|im_end|>", " spaces  and\nlines"):
        assert ours(text).input_ids == theirs(text).input_ids
    chat = [{"role": "user", "content": "hello there"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_a_cli_run_on_the_decoder_imports_no_model_code(tmp_path, model_dir):
    """The point of the decoder on a CPU: the process never imports transformers' model classes
    (their import graph is most of a run's start-up), and its summary says which code ran; with
    BATCHGEN_DECODER=0 the same run goes through transformers and writes the same text."""
    src = tmp_path / "jobs.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"One shared system prompt here. Question {i}"}) + "\n"
                           for i in range(4)))
    texts = {}
    for flag, code in (("1", "batchgen"), ("0", "transformers")):
        out = tmp_path / f"out{flag}.parquet"
        env = {**__import__("os").environ, "BATCHGEN_DECODER": flag}
        run = subprocess.run([sys.executable, "-X", "importtime", "-m", "batchgen", "process", str(src), "-o",
                              str(out), "--model", str(model_dir), "--max-new-tokens", "5", "--device", "cpu"],
                             capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time")}
        assert ("transformers.modeling_utils" in imported) == (code == "transformers")
        summary = json.loads(out.with_name(out.name + ".summary.json").read_text())
        assert summary["model_code"] == code
        assert summary["decoder_declined"] == (None if flag == "1" else "BATCHGEN_DECODER=0")  # why not the decoder
        import pyarrow.parquet as pq

        texts[flag] = pq.read_table(out).column("completion").to_pylist()
    assert texts["1"] == texts["0"]


def test_sharded_bfloat16_checkpoint_in_float32(tok, tmp_path):
    """A checkpoint in several safetensors files, stored in bfloat16, run in float32 on the decoder
    and on transformers' model code (both widen the same bfloat16 weights): the same greedy text."""
    make_model("qwen2", dtype=torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config, why = decoder_config.read(tmp_path)
    assert why is None and len(config.files) > 1
    dec = load_model(str(tmp_path), "cpu", "float32")[0]
    hf = load_model(str(tmp_path), "cpu", "float32", own_decoder=False)[0]
    assert isinstance(dec, Decoder) and dec.dtype == torch.float32
    reqs = edge_case_requests(tok, max_new_tokens=6)
    got = {(c.key, c.sample_index): c.token_ids for c in Engine(dec, eos_token_ids=EOS, min_shared_tokens=4).run(reqs)}
    for r in reqs:
        assert got[(r.key, 0)] == reference_generate(hf, r, EOS), r.key


def test_static_decode_steps_on_the_decoder(tok, tmp_path):
    """Decode steps on static shapes (what a CUDA graph captures) through the decoder."""
    model, dec = make_decoder("llama", tmp_path)
    reqs = edge_case_requests(tok, max_new_tokens=6)
    engine = Engine(dec, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=250, static_decode=True)
    got = {(c.key, c.sample_index): c.token_ids for c in engine.run(reqs)}
    for r in reqs:
        want = reference_generate(model, r, EOS)
        assert all(got[(r.key, s)] == want for s in range(r.params.n)), r.key


def test_a_hub_id_in_the_local_cache_runs_on_the_decoder(tmp_path, monkeypatch):
    """`--model org/name` that is in the local Hugging Face cache: the decoder reads its snapshot."""
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--tiny--llama" / "snapshots" / "abc123"
    make_model("llama").save_pretrained(snapshot)
    (tmp_path / "hub" / "models--tiny--llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny--llama" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model, source = load_model("tiny/llama", "cpu", "float32")
    assert source == "tiny/llama" and isinstance(model, Decoder) and model.config.path == str(snapshot)
    assert isinstance(load_config("tiny/llama"), decoder_config.DecoderConfig)


@pytest.mark.parametrize("flag", ["1", "0"])
def test_a_truncated_checkpoint_is_a_clear_error(flag, tmp_path, model_dir):
    """On either model code: exit 1, one line naming the model and the fix, no traceback."""
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 1000)
    src = tmp_path / "jobs.jsonl"
    src.write_text(json.dumps({"prompt": "hello"}) + "\n")
    env = {**__import__("os").environ, "BATCHGEN_DECODER": flag}
    run = subprocess.run([sys.executable, "-m", "batchgen", "process", str(src), "-o", str(tmp_path / "o.parquet"),
                          "--model", str(broken), "--device", "cpu", "--max-new-tokens", "2"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-1500:]
    assert "damaged or truncated" in run.stderr and str(broken) in run.stderr


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 24}


@pytest.mark.parametrize("arch, changes", [
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),  # beside rope_parameters: it wins
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24}}),
    ("qwen2", {"rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32, "type": "yarn"}}),  # Qwen2.5's card
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": {"rope_type": "default"}}),
    ("llama", {"rope_parameters": _DROP, "rope_theta": 5e5, "rope_scaling": _LLAMA3}),  # Llama 3.1's layout
    ("llama", {"rope_parameters": {**_LLAMA3, "rope_theta": 1e4}, "original_max_position_embeddings": 16}),
    ("mistral", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}),
])
def test_rope_tables_are_transformers(arch, changes, tmp_path):
    """The decoder's rotary tables equal, bit for bit, what transformers' rotary module of the same
    directory computes: `rope_scaling` beside `rope_parameters` and the legacy top-level keys read
    as transformers standardizes them."""
    from transformers import AutoModelForCausalLM

    make_model(arch).save_pretrained(tmp_path)
    _edit(tmp_path, **changes)
    config, why = decoder_config.read(tmp_path)
    assert why is None, why
    dec = Decoder(config, torch.device("cpu"), torch.float32)
    rotary = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).model.rotary_emb
    pos = torch.arange(300)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos[None])
    ours_cos, ours_sin = dec._rope(pos)
    half = config.head_dim // 2
    assert torch.equal(ours_cos[:, 0], cos[0])
    assert torch.equal(ours_sin[:, 0, half:], sin[0, :, half:]) and torch.equal(-ours_sin[:, 0, :half], sin[0, :, :half])


def test_rope_tables_are_accurate_where_aten_would_split_them_across_threads(tmp_path):
    """A table of 4,096 positions (ATen splits a cos of more than 2,048 elements across its threads):
    every entry within float32 rounding of the float64 value of the same float32 angle. In the
    lm-eval backend a worker thread's first MKL cos in a process once came out 1.5e-4 off on half a
    table, and every score of a run with it (BENCHMARKS.md)."""
    from batchgen.pipeline.model import rope

    make_model("llama").save_pretrained(tmp_path)
    config, why = decoder_config.read(tmp_path)
    assert why is None, why
    dec = Decoder(config, torch.device("cpu"), torch.float32)
    pos = torch.arange(4096)
    cos, sin = dec._rope(pos)
    inv, scale = rope.inv_freq(config.rope_parameters, config.hidden_size, config.num_attention_heads,
                               config.head_dim, config.max_position_embeddings)
    angles = pos.float()[:, None] * inv.float()[None, :]
    angles = torch.cat((angles, angles), dim=-1).double()
    half = config.head_dim // 2
    want_sin = angles.sin() * scale
    want_sin[:, :half] *= -1
    assert (cos[:, 0].double() - angles.cos() * scale).abs().max() < 1.2e-7
    assert (sin[:, 0].double() - want_sin).abs().max() < 1.2e-7


def test_on_this_thread_computes_in_parts_aten_runs_on_the_calling_thread():
    """Each part at most ATen's grain for elementwise ops (so it is never split across threads), and
    the parts together are the op of the whole, in its shape."""
    from batchgen.pipeline.model import kernels

    sizes = []

    def cos(t):
        sizes.append(t.numel())
        return torch.cos(t)

    x = torch.linspace(-700.0, 700.0, 1031 * 16).view(1031, 16)
    got = kernels.on_this_thread(cos, x)
    assert got.shape == x.shape and len(sizes) > 1 and max(sizes) <= kernels._ELEMENTWISE_GRAIN
    assert sum(sizes) == x.numel()
    assert (got.double() - x.double().cos()).abs().max() < 1.2e-7


@pytest.mark.parametrize("types, windows", [(["full_attention", "full_attention"], (None, None)),
                                            (["sliding_attention", "full_attention"], (12, None)),
                                            (None, (12, 12))])
def test_mistral_layer_types_are_windows_per_layer(types, windows, tmp_path):
    """Mistral with `layer_types` runs as Ministral in transformers: a window only on its sliding
    layers. The decoder's logits equal transformers' forward past the window."""
    from transformers import AutoModelForCausalLM

    make_model("mistral").save_pretrained(tmp_path)
    _edit(tmp_path, layer_types=types)
    config, why = decoder_config.read(tmp_path)
    assert why is None and config.layer_windows == windows
    dec = Decoder(config, torch.device("cpu"), torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = PrefixKV(dec.layer_shapes(), len(ids), torch.float32, torch.device("cpu"))
    step = build([], [], [(Segment(0, 0, kv.k, kv.v, 0, 0, 0), ids)], None, torch.device("cpu"))
    with torch.inference_mode():
        got, want = dec.forward(step, torch.arange(len(ids))), model(torch.tensor([ids])).logits[0]
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("flag", ["1", "0"])
@pytest.mark.parametrize("changes, says", [({"intermediate_size": 1024}, "model.layers.0.mlp.down_proj.weight has shape"),
                                           ({"is_causal": False}, "is_causal"),
                                           ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e5,
                                                                 "original_max_position_embeddings": 4096,
                                                                 "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}},
                                            "longrope")])
def test_a_config_no_model_code_runs_exactly_is_one_line(changes, says, flag, tmp_path, model_dir):
    """Tensors that disagree with config.json (transformers: "size mismatch"), is_causal false
    (transformers' masks turn bidirectional) and longrope (factors chosen per packed forward): on
    either model code, `process` exits 1 with one line naming the model, no traceback, and
    `validate` reports the same."""
    import os

    broken = tmp_path / "model"
    broken.mkdir()
    for f in model_dir.iterdir():  # the weights linked, not copied
        (broken / f.name).symlink_to(f) if f.name.endswith(".safetensors") else (broken / f.name).write_bytes(f.read_bytes())
    _edit(broken, **changes)
    src = tmp_path / "jobs.jsonl"
    src.write_text(json.dumps({"prompt": "hello"}) + "\n")
    env = {**os.environ, "BATCHGEN_DECODER": flag}
    for command in (["process", str(src), "-o", str(tmp_path / "o.parquet"), "--max-new-tokens", "2", "--device", "cpu"],
                    ["validate", str(src)]):
        run = subprocess.run([sys.executable, "-m", "batchgen", *command, "--model", str(broken)],
                             capture_output=True, text=True, env=env)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-1500:]
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and says in lines[0] and str(broken) in lines[0], run.stderr[-1500:]


def test_longrope_is_refused_on_transformers_model_code(tmp_path):
    """A model the decoder does not take (Phi-3) with longrope: transformers' model code would pick
    the long factors for a short row packed beside a long one; refused, by load_config too."""
    from batchgen.pipeline.model.load import ModelLoadError

    make_model("phi3").save_pretrained(tmp_path)
    _edit(tmp_path, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                     "original_max_position_embeddings": 24, "short_factor": [1.0] * 4,
                                     "long_factor": [2.0] * 4})
    for load in (lambda: load_model(str(tmp_path), "cpu", "float32"), lambda: load_config(str(tmp_path))):
        with pytest.raises(ModelLoadError, match="longrope"):
            load()
