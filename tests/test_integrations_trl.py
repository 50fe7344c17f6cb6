"""TRL GRPOTrainer integration: a real trl.GRPOTrainer (1.16.0) on CPU with a tiny Qwen2 built from config
and a BPE tokenizer trained here (nothing downloaded)."""

from __future__ import annotations

import inspect
import logging

import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from lld_monitor import lld  # noqa: E402

CORPUS = [
    "question: what is the capital of france? <search> capital of france </search>",
    "<information> paris is the capital of france </information> <answer> paris </answer>",
    "question: who wrote hamlet? <answer> shakespeare </answer>",
] * 10


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def make_tokenizer():
    """The tiny BPE tokenizer, trained here (also used by tests/_trl_multiproc_run.py)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>", "<unk>", "<answer>", "</answer>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_model(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def reward_len(completions, **kwargs):
    return [float(len(c) % 5) / 4.0 for c in completions]


def grpo_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=8, max_steps=3, num_iterations=2, logging_steps=1, report_to=[], use_cpu=True,
                learning_rate=5e-3, save_strategy="no", bf16=False, seed=0, disable_tqdm=True,
                dataloader_num_workers=0)
    base.update(kw)
    return GRPOConfig(**base)


def dataset():
    return Dataset.from_dict({"prompt": ["question: what is the capital", "question: who wrote",
                                         "<search> capital", "the answer is"] * 4})


def test_trl_contract():
    """The TRL internals the hook relies on (TRL moves fast: fail loudly when they change)."""
    assert trl.__version__ == "1.16.0"
    sig = inspect.signature(GRPOTrainer._compute_loss)
    assert list(sig.parameters) == ["self", "model", "inputs"]
    sig = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies)
    params = list(sig.parameters)
    assert params[:5] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep"]
    assert "compute_entropy" in params and sig.parameters["compute_entropy"].default is False
    assert "tuple" in str(sig.return_annotation) and str(sig.return_annotation).count("Tensor") >= 3  # 3-tuple
    assert list(inspect.signature(GRPOTrainer._calculate_rewards).parameters) == [
        "self", "inputs", "prompts", "completions", "completion_ids_list"]
    assert list(inspect.signature(GRPOTrainer._generate_and_score_completions).parameters) == ["self", "inputs"]
    src = inspect.getsource(GRPOTrainer._compute_loss)
    for needle in ('inputs.get("old_per_token_logps")', 'inputs["advantages"]', 'inputs["completion_mask"]',
                   "compute_entropy=True", "self.current_gradient_accumulation_steps"):
        assert needle in src, needle
    src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "rewards_per_func = self._calculate_rewards(" in src and "process_slice" in src


def _fixed_batch(trainer, tokenizer, seed=1, answer_ids=None):
    g = torch.Generator().manual_seed(seed)
    B, P, T = 6, 5, 9
    prompt_ids = torch.randint(5, len(tokenizer), (B, P), generator=g)
    completion_ids = torch.randint(5, len(tokenizer), (B, T), generator=g)
    if answer_ids is not None:  # rows 1 and 4 end with "<answer> x </answer>"
        for i in (1, 4):
            completion_ids[i, 5], completion_ids[i, 7] = answer_ids
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[0, 6:] = 0
    completion_mask[3, 4:] = 0
    model = trainer.model
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt_ids, completion_ids], 1)).logits
        cur = lld.token_logprobs(logits[:, P - 1 : -1], completion_ids)
    # old log-probs: current ones moved up and down, so some tokens fell (d > 0) and some rose
    noise = torch.randn(B, T, generator=g) * 0.3
    old = cur + noise
    return {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, 0.5, 0.0, -0.7, 1.2, -1.0]),
        "old_per_token_logps": old,
        "num_items_in_batch": completion_mask.sum(),
    }, cur


@pytest.mark.parametrize("cfg", [lld.LLDSConfig(lam=0.3), lld.LLDSConfig(lam=0.2, gate="response", norm="token_mean"),
                                 lld.LLDSConfig(lam=0.3, answer_weight=0.1)])
def test_llds_option_adds_exactly_the_llds_term(tokenizer, tmp_path, cfg):
    from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer

    torch.set_num_threads(1)
    a_open = tokenizer.convert_tokens_to_ids(["<answer>"])
    a_close = tokenizer.convert_tokens_to_ids(["</answer>"])
    trainer = LLDGRPOTrainer(model=tiny_model(tokenizer), reward_funcs=reward_len, args=grpo_args(tmp_path),
                             train_dataset=dataset(), processing_class=tokenizer, llds=cfg,
                             answer_open_ids=a_open, answer_close_ids=a_close)
    trainer.model.train()
    # set by Trainer.train() before the first loss; a fixed batch outside train() needs it too
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    inputs, cur = _fixed_batch(trainer, tokenizer, answer_ids=(a_open[0], a_close[0]))
    plain = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    with_llds = trainer._compute_loss(trainer.model, inputs)
    mask = inputs["completion_mask"].bool()
    answer = lld.answer_span_mask(inputs["completion_ids"], mask, a_open, a_close)
    assert int(answer.sum()) > 0
    term, st = lld.llds_loss(cur, inputs["old_per_token_logps"], inputs["advantages"], mask, cfg,
                             answer_mask=answer if cfg.masks_answer else None)
    expected = cfg.lam * float(term) / trainer.current_gradient_accumulation_steps
    assert expected > 1e-3 and st["n_penalized_tokens"] > 0  # the term is not trivially zero
    assert float(with_llds.detach()) - float(plain.detach()) == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert trainer.lld_last_term == pytest.approx(expected, rel=1e-6)
    # and the gradient differs by the LLDS gradient
    trainer.model.zero_grad()
    trainer._compute_loss(trainer.model, inputs).backward()
    g_llds = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    trainer.model.zero_grad()
    GRPOTrainer._compute_loss(trainer, trainer.model, inputs).backward()
    g_plain = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    assert any(not torch.allclose(a, b) for a, b in zip(g_llds, g_plain, strict=True))


def test_grpo_trainer_run_logs_into_the_store(tokenizer, tmp_path, caplog):
    from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer
    from lld_monitor.store import open_store_reader

    torch.set_num_threads(1)
    store = tmp_path / "store"
    answer_open = tokenizer.convert_tokens_to_ids(["<answer>"])
    answer_close = tokenizer.convert_tokens_to_ids(["</answer>"])
    trainer = LLDGRPOTrainer(model=tiny_model(tokenizer), reward_funcs=reward_len, args=grpo_args(tmp_path),
                             train_dataset=dataset(), processing_class=tokenizer, lld_store=str(store),
                             lld_run_name="trl tiny", llds=lld.LLDSConfig(lam=0.2),
                             answer_open_ids=answer_open, answer_close_ids=answer_close)
    trainer.train()
    assert trainer.lld_logger._closed
    with open_store_reader(store) as r:
        runs = r.runs()
        assert len(runs) == 1
        run = runs.iloc[0]
        assert run["source"] == "trl" and run["mode"] == "llds" and run["status"] == "finished"
        steps = r.steps(run["run_id"]).set_index("step")
        assert steps.index.tolist() == [1, 2, 3]
        # step 1 is the first pass over the generation batch: old == new; step 2 reuses it after one update
        assert abs(steps.loc[1, "delta_preserved"]) < 1e-4
        assert abs(steps.loc[2, "delta_preserved"]) > 1e-4
        assert steps["grad_norm"].notna().all() and steps["lr"].notna().all()
        assert steps["reward_mean"].notna().all() and steps["entropy"].notna().all()
        assert (steps["n_samples"] == 4).all()
        for s in (1, 2, 3):
            assert steps.loc[s, "llds_loss"] >= 0
        m = r.metrics(run["run_id"])
        assert {"trl/loss", "trl/reward", "trl/num_tokens"} <= set(m["key"])
        tok_steps = r.token_steps(run["run_id"])
        assert tok_steps == [1, 2, 3]
        tokens = r.tokens(run["run_id"], 2)
        assert len(tokens) > 0 and tokens["logp_new"].notna().all()
        assert tokens["token_text"].notna().all()
        samples = r.samples(run["run_id"], step=2)
        assert len(samples) == 4 and samples["text"].notna().all()
        # Δ per sample matches the tokens, and each reward belongs to its own completion (TRL shuffles the
        # generation batch; the reward must travel with it)
        for _, srow in samples.iterrows():
            t = tokens[tokens["sample_idx"] == srow["sample_idx"]].sort_values("position")
            text = tokenizer.decode(t["token_id"].tolist(), skip_special_tokens=True)
            assert srow["reward"] == reward_len([text])[0]
            assert srow["delta_sum"] == pytest.approx(float((t["logp_new"] - t["logp_old"]).sum()), abs=1e-4)
        # the dashboard's data functions read it
        from lld_monitor.ui import queries

        ov = queries.run_overview(r, run["run_id"])
        assert ov is not None
        frames = queries.compare_frames(r, [run["run_id"]], ["trl tiny"])
        assert len(frames) >= 1
    # and the dashboard's pages render it
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    root = Path(__file__).resolve().parents[1]
    for page in ("live_health.py", "token_inspector.py"):
        at = AppTest.from_file(str(root / "pages" / page), default_timeout=60)
        at.session_state["store_path"] = str(store)
        at.run()
        assert not at.exception, (page, at.exception)
        assert not at.error, (page, [e.value for e in at.error])


def test_grad_accumulation_and_sparse_logging(tokenizer, tmp_path):
    """2 micro-batches per optimizer step and TRL logging every 2nd step: one steps row per optimizer step
    with all of its samples; TRL's scalars only where TRL logged."""
    from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer
    from lld_monitor.store import open_store_reader

    torch.set_num_threads(1)
    store = tmp_path / "store"
    args = grpo_args(tmp_path, gradient_accumulation_steps=2, logging_steps=2, max_steps=3, num_iterations=1)
    trainer = LLDGRPOTrainer(model=tiny_model(tokenizer), reward_funcs=reward_len, args=args,
                             train_dataset=dataset(), processing_class=tokenizer, lld_store=str(store))
    trainer.train()
    with open_store_reader(store) as r:
        run = r.runs().iloc[0]
        assert run["mode"] == "vanilla"
        steps = r.steps(run["run_id"]).set_index("step")
        assert steps.index.tolist() == [1, 2, 3]
        assert (steps["n_samples"] == 8).all()
        assert (steps["llds_loss"] == 0).all()
        # num_iterations=1: TRL's old log-probs are the current ones, so the displacement is exactly 0
        assert (steps["delta_preserved"].abs() < 1e-6).all()
        assert steps["grad_norm"].notna().tolist() == [False, True, False]
        assert len(r.samples(run["run_id"], step=3)) == 8


# --------------------------------------------------------------------------- guards, tools, adaptive β


def test_unsupported_trl_internals_raise_a_clear_error():
    """If TRL's internals move, construction fails naming the supported range (LLDS can never silently no-op)."""
    from lld_monitor.integrations.trainers.trl import SUPPORTED_TRL, UnsupportedTRLError, check_trl_internals

    check_trl_internals()  # the installed TRL is supported

    class Moved(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None):  # compute_entropy gone
            raise AssertionError

        def _compute_loss(self, model, inputs):  # no longer asks for entropies
            return 0.0

    with pytest.raises(UnsupportedTRLError) as ei:
        check_trl_internals(Moved)
    assert SUPPORTED_TRL in str(ei.value) and "pip install" in str(ei.value)


def test_uncaptured_forward_raises_instead_of_silently_dropping_llds(tokenizer, tmp_path, monkeypatch):
    from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer, UnsupportedTRLError

    trainer = LLDGRPOTrainer(model=tiny_model(tokenizer), reward_funcs=reward_len, args=grpo_args(tmp_path),
                             train_dataset=dataset(), processing_class=tokenizer, llds=lld.LLDSConfig(lam=0.3))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs, _ = _fixed_batch(trainer, tokenizer)
    # a TRL whose loss no longer goes through the captured method
    monkeypatch.setattr(LLDGRPOTrainer, "_get_per_token_logps_and_entropies",
                        lambda self, *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(self, *a, **k))
    with pytest.raises(UnsupportedTRLError):
        trainer._compute_loss(trainer.model, inputs)


@pytest.mark.parametrize(("ga", "spg", "mu", "kept"), [(4, 2, 2, False), (1, 1, 2, True), (2, 2, 1, False),
                                                       (4, 4, 1, False), (3, 2, 1, True)])
def test_old_logps_warning_uses_trls_rule(tokenizer, tmp_path, caplog, ga, spg, mu, kept):
    from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer

    args = grpo_args(tmp_path, gradient_accumulation_steps=ga, steps_per_generation=spg, num_iterations=mu,
                     per_device_train_batch_size=4, num_generations=4)
    with caplog.at_level(logging.WARNING, logger="lld_monitor.integrations.trainers.trl"):
        trainer = LLDGRPOTrainer(model=tiny_model(tokenizer), reward_funcs=reward_len, args=args,
                                 train_dataset=dataset(), processing_class=tokenizer, llds=lld.LLDSConfig())
    assert trainer.lld_old_logps_kept is kept
    warned = any("keeps no old log-probs" in r.getMessage() for r in caplog.records)
    assert warned is (not kept)


def _with_tools(inputs):
    """Rows 1 and 4 carry tool results: tool_mask 0 on positions 2-3 (one call) and 5-6 (a second call, row 4)."""
    tool = torch.ones_like(inputs["completion_mask"])
    tool[1, 2:4] = 0
    tool[4, 2:4] = 0
    tool[4, 5:7] = 0
    return {**inputs, "tool_mask": tool}


def test_tool_tokens_excluded_and_adaptive_beta_from_tool_calls(tokenizer, tmp_path):
    """TRL tool calling (`tools=` / rollout_func env_mask -> tool_mask): tool tokens are not in the LLDS term,
    and LLDS-MA's adaptive β uses V = mean tool calls per completion of the generation batch."""
    from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer, tool_call_counts

    torch.set_num_threads(1)
    a_open = tokenizer.convert_tokens_to_ids(["<answer>"])
    a_close = tokenizer.convert_tokens_to_ids(["</answer>"])
    cfg = lld.LLDSConfig(lam=0.3, adaptive_beta="paper", v_base=2.0)
    trainer = LLDGRPOTrainer(model=tiny_model(tokenizer), reward_funcs=reward_len, args=grpo_args(tmp_path),
                             train_dataset=dataset(), processing_class=tokenizer, llds=cfg,
                             answer_open_ids=a_open, answer_close_ids=a_close)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    base, cur = _fixed_batch(trainer, tokenizer, answer_ids=(a_open[0], a_close[0]))
    inputs = _with_tools(base)
    calls = tool_call_counts(inputs["completion_mask"], inputs["tool_mask"])
    assert calls.tolist() == [0, 1, 0, 0, 2, 0]
    inputs["lld_tool_calls_mean"] = torch.tensor(0.5)  # what _generate_and_score_completions puts there
    plain = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    got = trainer._compute_loss(trainer.model, inputs)
    action = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    answer = lld.answer_span_mask(inputs["completion_ids"], action, a_open, a_close)
    term, st = lld.llds_loss(cur, inputs["old_per_token_logps"], inputs["advantages"], action, cfg,
                             answer_mask=answer, valid_searches_mean=0.5)
    assert st["beta"] == pytest.approx(0.25)  # paper rule: min(V / v_base, 1)
    assert float(got.detach()) - float(plain.detach()) == pytest.approx(cfg.lam * float(term), rel=1e-5, abs=1e-7)
    # changing the tool tokens' log-probs does not change the LLDS term: they are excluded
    old2 = inputs["old_per_token_logps"].clone()
    old2[~action & inputs["completion_mask"].bool()] += 5.0
    term2, _ = lld.llds_loss(cur, old2, inputs["advantages"], action, cfg, answer_mask=answer, valid_searches_mean=0.5)
    assert float(term2) == pytest.approx(float(term), rel=1e-6)


def test_adaptive_beta_trainer_run(tokenizer, tmp_path):
    """LLDSConfig(adaptive_beta=...) trains (it used to crash at step 1 with no source of search counts)."""
    from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer
    from lld_monitor.store import open_store_reader

    torch.set_num_threads(1)
    store = tmp_path / "store"
    trainer = LLDGRPOTrainer(model=tiny_model(tokenizer), reward_funcs=reward_len,
                             args=grpo_args(tmp_path, max_steps=2), train_dataset=dataset(),
                             processing_class=tokenizer, lld_store=str(store),
                             llds=lld.LLDSConfig(lam=0.2, adaptive_beta="code"),
                             answer_open_ids=tokenizer.convert_tokens_to_ids(["<answer>"]),
                             answer_close_ids=tokenizer.convert_tokens_to_ids(["</answer>"]))
    trainer.train()
    with open_store_reader(store) as r:
        run = r.runs().iloc[0]
        assert run["mode"] == "llds_ma"
        steps = r.steps(run["run_id"]).set_index("step")
        assert steps.index.tolist() == [1, 2]
        assert (steps["searches_per_response"] == 0).all()  # no tools here: V = 0 tool calls
        assert steps["llds_loss"].notna().all()


# --------------------------------------------------------------------------- noise: on-policy micro-batches (issue 29)


@pytest.mark.parametrize(("ga", "spg", "mu", "vllm", "noise_only"), [
    (1, 1, 1, True, True), (4, 4, 1, True, True), (4, 2, 2, True, True),  # vLLM IS correction, used up in one step
    (1, 1, 2, True, False), (2, 4, 1, True, False),  # the second pass / a later step sees an update
    (1, 1, 1, False, False),  # no vLLM: no old log-probs at all (Δ ≡ 0, the other warning)
])
def test_llds_sees_only_noise_rule(tmp_path, ga, spg, mu, vllm, noise_only):
    from lld_monitor.integrations.trainers.trl import llds_sees_only_noise

    args = grpo_args(tmp_path, gradient_accumulation_steps=ga, steps_per_generation=spg, num_iterations=mu)
    assert llds_sees_only_noise(args, mu, use_vllm=vllm, vllm_is_correction=True) is noise_only


def test_on_policy_micro_batch_gets_no_llds_gradient(tokenizer, tmp_path, caplog):
    """Old log-probs computed by the current parameters (no optimizer step since the generation batch was scored,
    as with vLLM's IS correction and μ = 1): Δ is recomputation noise (1e-7 here) and the LLDS term, whose gradient
    does not shrink with |Δ|, must not act on it. After an optimizer step the same displacement counts again."""
    from lld_monitor.integrations.trainers.trl import LLDGRPOTrainer

    torch.set_num_threads(1)
    trainer = LLDGRPOTrainer(model=tiny_model(tokenizer), reward_funcs=reward_len, args=grpo_args(tmp_path),
                             train_dataset=dataset(), processing_class=tokenizer, llds=lld.LLDSConfig(lam=0.5))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs, cur = _fixed_batch(trainer, tokenizer)
    g = torch.Generator().manual_seed(4)
    inputs["old_per_token_logps"] = cur + torch.randn(cur.shape, generator=g) * 1e-7  # recomputation noise
    inputs["lld_gen_step"] = torch.tensor(trainer.state.global_step)  # scored at this very optimizer step

    def grads(fn):
        trainer.model.zero_grad()
        fn(trainer, trainer.model, inputs).backward()
        return [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    with caplog.at_level(logging.WARNING, logger="lld_monitor.integrations.trainers.trl"):
        g_llds = grads(LLDGRPOTrainer._compute_loss)
    g_plain = grads(GRPOTrainer._compute_loss)
    assert all(torch.equal(a, b) for a, b in zip(g_llds, g_plain, strict=True))
    assert trainer.lld_last_term == 0.0
    assert any("recomputation noise" in r.getMessage() for r in caplog.records)
    # an optimizer step later (and |Δ| above the floor) the term is back
    inputs["old_per_token_logps"] = cur + torch.randn(cur.shape, generator=g) * 0.3
    trainer.state.global_step += 1
    g_llds = grads(LLDGRPOTrainer._compute_loss)
    g_plain = grads(GRPOTrainer._compute_loss)
    assert trainer.lld_last_term > 0
    assert any(not torch.equal(a, b) for a, b in zip(g_llds, g_plain, strict=True))
