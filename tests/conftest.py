"""Shared fixtures. Sets 8 fake CPU devices before jax is imported (the only place that does).

The suite's wall time is mostly XLA:CPU compiling small programs, so two settings serve every
test process and the subprocesses tests start (`xla_flags` builds their XLA_FLAGS):
- `--xla_backend_optimization_level=0`: LLVM does not optimise the generated machine code. Every
  HLO pass still runs (the same fusions, layouts and arithmetic), and the matmuls are Eigen's
  either way; compiling takes about half the CPU time. Benchmarks, tools and runs outside the
  tests compile at XLA's default.
- one persistent compilation cache per test session, exported (JAX_COMPILATION_CACHE_DIR), so
  the xdist workers and the `jgrpo` subprocesses they start share what any of them compiled."""

import atexit
import os
import shutil
import tempfile

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",)
"""XLA flags of every test process besides the device count (see the module docstring)."""


def xla_flags(devices=8) -> str:
    """XLA_FLAGS for a process with `devices` fake CPU devices (None: jax's default, one)."""
    count = () if devices is None else (f"--xla_force_host_platform_device_count={devices}",)
    return " ".join((*TEST_XLA_FLAGS, *count))


# an xdist worker inherits the controller's environment: set each flag once
_inherited = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(
    [*_inherited, *(f for f in xla_flags(8).split() if f not in _inherited)]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # the session's cache, made by the first process that loads this file (the xdist controller):
    # a hit skips XLA's compile, not the trace, so compile counts stay
    _XLA_CACHE = tempfile.mkdtemp(prefix="jgrpo-tests-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jgrpo.models.tiny import tiny_model_fields  # noqa: E402

TINY_MODEL_FIELDS = tiny_model_fields()
"""TransformerConfig fields of the tiny Qwen2-shaped model the step tests train (d 32, GQA)."""


ROLLOUT_BATCH_BUCKET = "rollout.prompt_bucket=5"
"""The override a step built for `make_rollout_batch` needs: its completions start at column 5
(the step scores columns from rollout.prompt_bucket on)."""


def make_rollout_batch(seed, num_prompts=4, group=4, prompt_len=5, total_len=14, vocab=64):
    """A synthetic rollout batch (the trainer -> step boundary) with ragged lengths; completions
    from column `prompt_len` on (build the step with ROLLOUT_BATCH_BUCKET)."""
    rng = np.random.RandomState(seed)
    b = num_prompts * group
    input_ids = rng.randint(1, vocab, (b, total_len)).astype(np.int32)
    attention_mask = np.ones((b, total_len), np.float32)
    token_mask = np.zeros((b, total_len), np.float32)
    for i in range(b):
        pad = rng.randint(0, 3)  # left padding of the prompt
        attention_mask[i, :pad] = 0
        input_ids[i, :pad] = 0
        gen = rng.randint(2, total_len - prompt_len + 1)
        token_mask[i, prompt_len : prompt_len + gen] = 1
        attention_mask[i, prompt_len + gen :] = 0  # right padding after EOS
        input_ids[i, prompt_len + gen :] = 0
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        token_mask=token_mask,
        generation_logprobs=(-rng.rand(b, total_len) * 2 - 1).astype(np.float32),
        rewards=rng.randint(0, 2, b).astype(np.float32),
        group_ids=np.repeat(np.arange(num_prompts), group).astype(np.int32),
        sample_mask=np.ones(b, np.float32),
    )


def memory_map_count() -> int:
    """Memory mappings this process holds (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:
        return 0


def memory_map_limit() -> int | None:
    """The kernel's per-process limit on memory mappings (vm.max_map_count), or None."""
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return None


MEMORY_MAP_LIMIT = memory_map_limit()
"""vm.max_map_count, read once per test process (None: not Linux)."""


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """After a test, drop every compiled program once the process holds a quarter of the
    kernel's memory-mapping limit (later tests compile theirs again, or load them from the
    session's persistent cache).

    XLA:CPU maps each compiled program's code into memory in several mappings (about ten for a
    small program, more for a large one), and they live as long as jax's caches keep the
    program. tests/test_sampling.py alone compiles enough to reach Linux's
    default vm.max_map_count (65530), after which LLVM's mmap failed ("LLVM compilation error:
    Cannot allocate memory") and the worker died in the exception that reported it. A test after
    which half the limit is still held once the caches are cleared fails here, by name."""
    yield
    limit = MEMORY_MAP_LIMIT
    if not limit or memory_map_count() <= limit // 4:
        return
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    held = memory_map_count()
    if held > limit // 2:
        pytest.fail(
            f"{held} memory mappings of vm.max_map_count {limit} held after jax.clear_caches(): "
            "something keeps compiled programs alive"
        )


@pytest.fixture
def rollout_batch():
    return make_rollout_batch(0)


@pytest.fixture(scope="module")
def warm_start():
    """tools/warm_start.py as a module (tools/ is not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "warm_start.py"
    spec = importlib.util.spec_from_file_location("warm_start", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["warm_start"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def with_kernels(model, kernels):
    """The same parameters (shared arrays) as `model` with `cfg.kernels` set: "cpu" or
    "portable" (jgrpo.models.kernels), so the GPU/TPU code path runs on CPU too."""
    import dataclasses

    from flax import nnx

    out = nnx.merge(*nnx.split(model))
    out.cfg = dataclasses.replace(out.cfg, kernels=kernels)
    return out


def make_random_hf_model(hf_config, seed=0):
    """A transformers model with random weights large enough that logits are O(1).

    HF's default init (std 0.02) makes every implementation look right; norms in [0.5, 1.5]
    and matrices with std 0.15 do not."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return model


def assert_hf_logits(folder, model, ids, atol=1e-4):
    """transformers loads the HF folder `folder` (an export, a run's final/) and gives the
    float32 logits of `model` (a jgrpo model, LoRA adapters included) on `ids` [B, T] to atol."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), want, atol=atol, rtol=0)


def assert_agent_batch_is_the_trainers(graphdef, params, result, rollout_cfg):
    """An agent rollout's step batch as the trainer sees it: the trainer's forward reproduces
    the sampler's recorded logprobs (token_mult_prob_error 1.0000), and each sequence's loss mask
    is exactly its call's completion ids, in the order of the calls."""
    import functools

    import jax
    from flax import nnx

    from jgrpo import step

    batch, ro = result.step_batch(), rollout_cfg
    forward = jax.jit(
        functools.partial(step.sequence_logprobs, graphdef, first_scored=ro.prompt_bucket)
    )
    lp = np.asarray(
        forward(nnx.to_pure_dict(params), batch.input_ids, batch.attention_mask, ro.temperature)
    )
    m = batch.token_mask > 0
    error = float(np.mean(np.exp(np.abs(lp[m] - batch.generation_logprobs[m]))))
    assert error <= 1.001 and round(error, 4) == 1.0, error
    for i, seq in enumerate(s for r in result.agent_rollouts for s in r.sequences):
        region = np.asarray(batch.input_ids[i])[-ro.max_new_tokens :][: len(seq.region)]
        assert region.tolist() == seq.region
        mask = np.asarray(batch.token_mask[i])[-ro.max_new_tokens :][: len(seq.region)] > 0
        assert mask.tolist() == seq.generated


def importable_modules(tmp_path_factory, sources: dict):
    """Generator for a module fixture: write {module name: source} into a fresh folder, put it
    on sys.path (inherited by child processes) and PYTHONPATH (Ray workers get the driver's),
    yield, take it off again."""
    folder = tmp_path_factory.mktemp("modules")
    for name, source in sources.items():
        (folder / f"{name}.py").write_text(source)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(folder))
    mp.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    )
    yield
    mp.undo()


REWARD_MODEL_TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>{% endfor %}"
)
"""The chat template of `build_reward_model`'s tokenizer."""


def build_reward_model(out, family="qwen2", *, pad=True, num_labels=1, seed=0, max_pos=256):
    """A random tiny transformers *ForSequenceClassification folder (llama, qwen2 or qwen3)
    with the char tokenizer (260 ids) and a chat template; `pad=False`: the tokenizer has no
    pad token (eos pads)."""
    import json
    from pathlib import Path

    import torch
    import transformers

    from jgrpo.models.tiny import save_char_tokenizer

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification),
    }[family]
    cfg = config_cls(
        vocab_size=260,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_pos,
        num_labels=num_labels,
        initializer_range=0.3,  # O(1) scores: a 1e-4 parity check means something
        rms_norm_eps=1e-6,
        pad_token_id=0 if pad else None,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases (init: ones and zeros)
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    save_char_tokenizer(out)
    tok_cfg = json.loads((Path(out) / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = REWARD_MODEL_TEMPLATE
    if not pad:
        del tok_cfg["pad_token"]
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return Path(out)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (starting one takes ~12 s): its GCS address,
    which a `jgrpo train` subprocess joins with rollout.ray_address."""
    import ray

    from jgrpo.rollout.ray_backend import init_ray

    started = init_ray(num_cpus=2)
    yield ray.get_runtime_context().gcs_address
    if started:
        ray.shutdown()


SPLITTING_AGENT = """
async def agent(client, record):
    messages = list(record["prompt_messages"])
    first = await client.chat.completions.create(model="p", messages=messages, max_tokens=6)
    ids = first.choices[0].token_ids
    if ids[0] % 2:  # a rewritten history: the rollout splits into two sequences
        messages = [{"role": "user", "content": "again"}]
    else:
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "more"}]
    second = await client.chat.completions.create(model="p", messages=messages, max_tokens=6)
    return (sum(ids) + sum(second.choices[0].token_ids)) % 7 / 6
"""
"""A data.agent module's source (async `agent`): two calls per rollout; an odd first token
rewrites the history, so those rollouts split into two sequences (the Ray and pod agent tests)."""
