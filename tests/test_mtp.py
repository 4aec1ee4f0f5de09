"""MTP: losslessness for K = 1..3 on the hybrid, speculative sampling's distribution, loading."""

import importlib

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import harness.loop as loop
from engines.drafters.mtp import MTPHead, load_mtp
from engines.errors import DrafterError, Unsupported
from engines.methods.mtp import MTP
from engines.runtime.cache import ROLLBACK_STRATEGIES
from engines.runtime.sampling import Sampler
from harness.generation import run_generation
from harness.models import fixtures
from tests.conftest import engine_cfg
from tests.helpers import base_engine, base_tokens, generate_ids
from tests.test_lossless import NEW_TOKENS, _units


def mtp_cfg(drafter, k=1, verify="batched"):
    return engine_cfg(block_size=k + 1, drafter=str(drafter), verify=verify)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_output_is_identical_to_base_on_every_builtin_prompt(models, k):
    model, tok = models["qwen35"]
    eng = MTP.build(model, mtp_cfg(fixtures.fixture_dir("qwen35"), k))
    tokens = rounds = partial = 0
    for uid, ids in _units(tok):
        got = generate_ids(eng, ids, NEW_TOKENS)
        assert got.tokens == base_tokens(model, ids, NEW_TOKENS), uid
        tokens, rounds = tokens + got.decode_tokens, rounds + len(got.rounds)
        partial += sum(0 < r.accepted < r.drafted for r in got.rounds)
    assert tokens / rounds > 1.3, "the fixture MTP head should be distilled from its target"
    if k > 1:
        assert partial > 10, "partial acceptance (mid-block rollback, DeltaNet included) must happen"


def test_sequential_verify_is_lossless_and_rolls_back_recurrent_state(models):
    model, tok = models["qwen35"]
    for strategy in ROLLBACK_STRATEGIES:
        eng = MTP.build(model, mtp_cfg(fixtures.fixture_dir("qwen35"), 3, "sequential"), rollback=strategy)
        for _, ids in list(_units(tok))[:5]:
            assert generate_ids(eng, ids, NEW_TOKENS).tokens == base_tokens(model, ids, NEW_TOKENS)


def test_mtp_on_a_sliding_window_target_is_unsupported(models):
    # an MTP head is built for Qwen3.5/Qwen3-Next and dense full-attention decoders, not Gemma 4
    with pytest.raises(Unsupported, match="this is gemma4"):
        MTP.build(models["gemma4"][0], mtp_cfg(fixtures.fixture_dir("gemma4")))


def _copy_ckpt(tmp_path, edit):
    src = fixtures.fixture_dir("qwen35")
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    w = mx.load(str(dst / "model.safetensors"))
    edit(w)
    mx.save_safetensors(str(dst / "model.safetensors"), w)
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda w: w.pop("mtp.fc.weight"), "mtp.fc.weight is missing"),
    (lambda w: w.update({"mtp.fc.weight": w["mtp.fc.weight"][:, :128]}), "mtp.fc.weight has shape (128, 128)"),
    (lambda w: [w.pop(k) for k in [k for k in w if k.startswith("mtp.")]], "no mtp.* tensors"),
])
def test_missing_or_misshaped_mtp_tensors_are_named(models, tmp_path, edit, message):
    with pytest.raises(DrafterError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")) as e:
        load_mtp(_copy_ckpt(tmp_path, edit), models["qwen35"][0])
    assert "\n" not in str(e.value)


def test_hf_form_checkpoints_get_gemma_style_norm_offsets(models, tmp_path):
    # An original HF checkpoint stores conv1d as [C, 1, K] and RMSNorm weights as w (scale 1 + w).
    model = models["qwen35"][0]
    plain = load_mtp(fixtures.fixture_dir("qwen35"), model)

    def to_hf(w):
        for k in [k for k in w if "conv1d.weight" in k]:
            w[k] = w[k].moveaxis(2, 1)
        for k in ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.q_norm.weight"):
            w[k] = w[k] - 1.0
    hf = load_mtp(_copy_ckpt(tmp_path, to_hf), model)
    for k in ("norm.weight", "pre_fc_norm_hidden.weight", "layers.0.self_attn.q_norm.weight"):
        a, b = dict(tree_flatten(plain.parameters()))[k], dict(tree_flatten(hf.parameters()))[k]
        assert mx.allclose(a, b, atol=1e-2).item(), k


# ---------------------------------------------------------------- sampling


def _small_vocab_checkpoint(tmp_path):
    """A qwen3_5 target with an 8-token vocabulary and an MTP head fitted to it, saved as a checkpoint.

    The head is fitted (seconds) so that its q resembles the target's p: drafts then hit
    the target's argmax often, which is exactly where naive acceptance goes wrong."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.utils import save_config, save_model

    from engines.runtime.hidden import capture_hidden, embed, final_norm, lm_head

    spec = {"model_type": "qwen3_5", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "full_attention_interval": 2,
            "linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": 8, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "max_position_embeddings": 256,
            "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    module = importlib.import_module("mlx_lm.models.qwen3_5")
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(spec))
    model.language_model.lm_head.weight *= 3.0  # p neither flat nor one-hot
    head = MTPHead(model)
    x = mx.random.randint(0, 8, (64, 12))
    with capture_hidden(model, (1,)) as sink:
        p = mx.softmax(model(x), axis=-1)  # [64, 12, 8]
    h = final_norm(model, sink[0])

    def loss_fn(m):  # position t: (h_t, token t+1) -> the target's p for token t+2
        logq = nn.log_softmax(lm_head(model, m(embed(model, x[:, 1:]), h[:, :-1])), axis=-1)
        return -(p[:, 1:] * logq).sum(-1).mean()

    opt = optim.Adam(learning_rate=1e-2)
    step = nn.value_and_grad(head, loss_fn)
    for _ in range(150):
        _, g = step(head)
        opt.update(head, g)
        mx.eval(head.parameters(), opt.state)
    save_model(tmp_path, model)
    save_config(spec, tmp_path / "config.json")
    w = mx.load(str(tmp_path / "model.safetensors"))
    w.update({f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    mx.save_safetensors(str(tmp_path / "model.safetensors"), w)
    return model


def _empirical(engine_for_seed, n=1000, length=4):
    """Token counts per output position over n seeded generations: [length, 8]."""
    counts = [[0] * 8 for _ in range(length)]
    for seed in range(n):
        gen = run_generation(engine_for_seed(), [1, 2, 3], length, Sampler(1.0, seed))
        for i, t in enumerate(gen.tokens):
            counts[i][t] += 1
    return counts


def _chi2(a, b):
    """Two-sample chi-square statistic over output positions 1.. (position 0 is the prefill's
    own sample, the same in every engine) and its degrees of freedom."""
    stat, dof = 0.0, 0
    for ra, rb in zip(a[1:], b[1:]):
        na, nb = sum(ra), sum(rb)
        cells = [(x, y) for x, y in zip(ra, rb) if x + y]
        for x, y in cells:
            ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
            stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
        dof += len(cells) - 1
    return stat, dof


CHI2_999 = {19: 43.82, 20: 45.31, 21: 46.80}  # chi-square quantile at p = 0.001 by degrees of freedom


def _naive_accept(tokens, q, logits, sampler, pos):
    # Compare-and-accept: keep drafts that equal the target's argmax, else sample p.
    choices = mx.argmax(logits, axis=-1).tolist()
    drafts = tokens.tolist()
    n = next((i for i, (x, c) in enumerate(zip(drafts, choices)) if x != c), len(drafts))
    p = sampler.probs(logits)
    return mx.array([n, *drafts[:n], sampler.draw(p[n:n + 1], pos + n, 3).item()])


def test_mtp_speculative_sampling_matches_base_sampling_and_naive_acceptance_does_not(tmp_path, monkeypatch):
    model = _small_vocab_checkpoint(tmp_path)
    cfg = mtp_cfg(tmp_path, k=2)
    base = _empirical(lambda: base_engine(model))
    mtp = _empirical(lambda: MTP.build(model, cfg))
    # 1000 seeded generations per engine; the same distribution passes a chi-square
    # test at p = 0.001 (measured: 31.0 on 21 dof), a biased one fails it (naive: 77.7).
    stat, dof = _chi2(base, mtp)
    assert stat < CHI2_999[dof], (stat, dof)
    monkeypatch.setattr(loop, "accept_speculative", _naive_accept)
    stat, dof = _chi2(base, _empirical(lambda: MTP.build(model, cfg)))
    assert stat > CHI2_999[dof], (stat, dof)
