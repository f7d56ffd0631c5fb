"""The masked-diffusion trainer's typed config (``difrl train configs/sudoku.yaml``).

    cfg = load_masked_config("configs/sudoku.yaml", ["estimator.kind=d1", "train.lr=1e-4"])

Estimators (docs/reference/specs/discrete-diffusion-rl.md §3): ``maskgrpo`` (one re-masked copy per inner
update, mask ratio r_n = min(c + (1 - c) n / mu, 0.999), fading-out AR-like or uniform masking,
loss over the masked answer tokens), ``d1`` (every answer token masked, optional prompt masking,
loss over all answer tokens) and ``coupled`` (coupled-GRPO: full view plus complementary views A / B
at t ~ U(t_low, t_high), weights 1/t and 1/(1 - t)). ``mu`` = train.inner_updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from difrl.config import cfg_field, config_error, load_config
from difrl.train.config import (AdvantageConfig, CorrectConfig, EvalConfig, LoraConfig, ModelConfig, TrainConfig,
                                TrainerConfig, set_keys)
from difrl.worlds import MASKED_KINDS, world_file


@dataclass
class MaskedModelConfig(ModelConfig):
    kind: str = cfg_field("sudoku", choices=MASKED_KINDS, help="sudoku: the bundled 4x4 Sudoku world; digit_tokens: the "
                                                                 "8x8 digits as 64 tokens over 17 grey levels; hf_masked: a "
                                                                 "local transformers masked LM on a text task")
    # hf_masked only (difrl/worlds/text_tasks.py): model.path is the transformers directory (None = the bundled tiny MLM)
    task: str = cfg_field("arithmetic", choices=("arithmetic", "countdown", "sudoku_text"), help="hf_masked: text task")
    problems: str | None = cfg_field(None, help="hf_masked: training problems (JSONL); None = the task's bundled set")
    gen_length: int = cfg_field(4, ge=2, help="hf_masked: answer block length in tokens (the answer, then EOS padding)")
    chat_template: bool = cfg_field(True, help="hf_masked: wrap the question in the tokenizer's chat template if it has one")
    trust_remote_code: bool = cfg_field(False, help="hf_masked: run the directory's own modelling code (LLaDA, Dream)")
    dtype: str = cfg_field("auto", choices=("auto", "fp32", "bf16", "fp16"),
                           help="hf_masked: weights dtype; auto = bf16 on a CUDA device that supports it, else fp32")
    gradient_checkpointing: bool = cfg_field(False, help="hf_masked: transformers gradient checkpointing")
    mask_id: int | None = cfg_field(None, ge=0, help="hf_masked: mask token id; None = the tokenizer's / config's")


@dataclass
class MaskedSamplerConfig:
    kind: str = cfg_field("llada", choices=("llada", "eb", "emerge"),
                          help="rollout sampler: LLaDA low-confidence remasking, EB-Sampler, or MDLM ancestral (emerge)")
    steps: int = cfg_field(16, ge=1, help="llada / emerge: total steps (llada 16 = one token per step for 4x4 Sudoku)")
    schedule: str = cfg_field("cosine", choices=("cosine", "linear"), help="emerge: masked fraction schedule k(tau)")
    block_length: int | None = cfg_field(None, ge=1, help="semi-autoregressive block length; None = one block")
    temperature: float = cfg_field(1.0, ge=0.0, help="rollout temperature (0 = greedy: no exploration)")
    gamma: float = cfg_field(0.1, ge=0.0, help="eb: entropy bound (sum H - max H <= gamma)")

    def sampler_kwargs(self, temperature: float | None = None) -> dict:
        """The rollout sampler's keyword arguments (difrl.discrete.samplers.SAMPLERS[kind]): the one place they are built."""
        if self.kind == "llada":
            kw = dict(steps=self.steps, block_length=self.block_length)
        elif self.kind == "eb":
            kw = dict(gamma=self.gamma, block_length=self.block_length)
        else:
            kw = dict(steps=self.steps, schedule=self.schedule)
        return kw | {"temperature": self.temperature if temperature is None else temperature}


@dataclass
class MaskedRolloutConfig:
    prompts_per_iter: int = cfg_field(16, ge=1, help="puzzles (groups) per iteration")
    group_size: int = cfg_field(8, ge=2, help="rollouts per puzzle")
    num_blanks: tuple[int, int] = cfg_field((4, 10), help="sudoku: training puzzles' blanks drawn uniformly from [lo, hi]")

    def validate(self) -> None:
        lo, hi = self.num_blanks
        if not 1 <= lo <= hi <= 16:
            raise config_error("num_blanks", f"[{lo}, {hi}] must satisfy 1 <= lo <= hi <= 16")


@dataclass
class EstimatorConfig:
    kind: str = cfg_field("maskgrpo", choices=("maskgrpo", "d1", "unigrpo", "coupled"),
                          help="log-prob estimator of the masked policy (spec section 3)")
    min_mask_rate: float = cfg_field(0.6, ge=0.0, lt=1.0, help="maskgrpo: c of the ratio sweep r_n = min(c + (1 - c) n / mu, 0.999)")
    remasking: str = cfg_field("arlike", choices=("arlike", "random"),
                               help="maskgrpo: fading-out AR-like (text) or i.i.d. Bernoulli(r_n) (UniGRPO / image tokens)")
    p_mask_prompt: float = cfg_field(0.0, ge=0.0, lt=1.0, help="d1: prompt-token masking probability (d1: 0.15; 0 = the "
                                                               "prompt is never masked)")
    timesteps: int = cfg_field(1000, ge=2, help="unigrpo: T of the structured noising t_n (ratio t_n / T)")
    t_low: float = cfg_field(0.2, gt=0.0, lt=1.0, help="coupled: t ~ U(t_low, t_high)")
    t_high: float = cfg_field(0.8, gt=0.0, lt=1.0)
    full_view: bool = cfg_field(True, help="coupled: average with the fully masked (d1) view, as DiffuCoder's code does")

    def validate(self) -> None:
        if self.t_low > self.t_high:
            raise config_error("t_low", f"{self.t_low} > estimator.t_high={self.t_high}")


@dataclass
class ExternalConfig:
    """External rollouts (ERILS): K of every group's G rollouts come from another policy."""
    source: str = cfg_field("none", choices=("none", "solver", "checkpoint"),
                            help="none: on-policy only; solver: the world's exact solver policy (sudoku); checkpoint: "
                                 "a stronger masked checkpoint (external.path) sampled with the run's sampler")
    path: str | None = cfg_field(None, help="checkpoint: the external policy's safetensors")
    per_group: int = cfg_field(1, ge=1, help="K: external rollouts in each group of rollout.group_size")
    temperature: float | None = cfg_field(None, ge=0.0, help="checkpoint: sampling temperature (None = sampler.temperature)")
    normalize: str = cfg_field("source", choices=("source", "joint"),
                               help="source: the group baseline (mean, std) comes from its on-policy members only, so "
                                    "external rollouts are judged against what the policy does now and do not move the "
                                    "on-policy advantages; joint: plain GRPO over the mixed group")
    correct: CorrectConfig = field(default_factory=lambda: CorrectConfig(method="token_tis"))  # the importance weight
    # of an external token, pi_old(o_k | decode context) / mu_ext(o_k | decode context), through difrl.correct

    def validate(self) -> None:
        if self.source == "checkpoint" and not self.path:
            raise config_error("source", "= checkpoint needs external.path (a masked checkpoint)")


@dataclass
class MaskedTrainConfig(TrainConfig):
    inner_updates: int = cfg_field(4, ge=1, help="mu: passes over each rollout, each with its own re-mask")
    # the flow trainer's micro-batch keys (docs/guides/scale.md "Micro-batches"), in sequences: micro_batch x grad_accum x
    # updates_per_epoch = this process's samples per pass (difrl/train/masked/plan.py)
    micro_batch: int | Literal["auto"] = cfg_field(
        64, ge=1, help="sequences per forward/backward; auto = each process's samples cut into "
                       "train.updates_per_epoch x train.grad_accum micro-batches, whatever the number of processes")
    updates_per_epoch: int | None = cfg_field(None, ge=1, help="optimizer updates per pass (inner update) over the "
                                                                "rollout: what micro_batch=auto keeps (None = 1); with "
                                                                "an explicit micro_batch a check that it gives this many")


@dataclass
class MaskedEvalConfig(EvalConfig):
    num_blanks: int = cfg_field(8, ge=1, le=16, help="sudoku: blanks of the fixed test puzzles")
    count: int = cfg_field(256, ge=1, help="sudoku: test puzzles (cut from the test solutions); hf_masked: at most this "
                                           "many test problems")
    problems: str | None = cfg_field(None, help="hf_masked: test problems (JSONL); None = the task's bundled test set")
    samples: int = cfg_field(8, ge=1, help="hf_masked: n samples per test problem for pass@k")
    pass_k: list[int] = cfg_field([1, 8], help="hf_masked: the k of pass@k (unbiased estimator), each <= eval.samples")

    def validate(self) -> None:
        if not self.pass_k or any(not 1 <= k <= self.samples for k in self.pass_k):
            raise config_error("pass_k", f"{self.pass_k}: each k must lie in [1, eval.samples={self.samples}]")


@dataclass
class MaskedConfig(TrainerConfig):
    """The masked trainer's config: the common sections with masked defaults (full fine-tuning, PPO clip 0.2, the
    k3 KL per token), plus the sampler, rollout, estimator and external sections."""
    trainer: ClassVar[str] = "masked"
    model: MaskedModelConfig = field(default_factory=MaskedModelConfig)
    sampler: MaskedSamplerConfig = field(default_factory=MaskedSamplerConfig)
    rollout: MaskedRolloutConfig = field(default_factory=MaskedRolloutConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    advantage: AdvantageConfig = field(default_factory=lambda: AdvantageConfig(eps=1e-5))
    external: ExternalConfig = field(default_factory=ExternalConfig)
    train: MaskedTrainConfig = field(default_factory=lambda: MaskedTrainConfig(
        lr=1e-4, weight_decay=0.0, micro_batch=64, clip_low=0.2, clip_high=0.2, ratio_tol=1e-5,
        lora=LoraConfig(enabled=False)))  # full fine-tuning suits the tiny bundled models
    eval: MaskedEvalConfig = field(default_factory=lambda: MaskedEvalConfig(every=0))

    def validate(self) -> None:
        super().validate()
        # how the samples split over processes and into updates is checked where the number of processes is known
        # (difrl.train.masked.plan.plan_masked_iteration, at start-up)
        ext = self.external
        if ext.source != "none" and ext.per_group >= self.rollout.group_size:
            raise config_error("external.per_group", f"{ext.per_group} external rollouts leave no on-policy rollout in a "
                                                     f"group of rollout.group_size={self.rollout.group_size}")
        world = world_file(self.model.kind)
        if ext.source == "solver" and getattr(world, "solver_sample", None) is None:
            raise config_error("external.source", f"the solver source needs a world with an exact solver (model.kind="
                                                  f"sudoku), not {self.model.kind!r}")
        if self.reward.overlap:
            raise config_error("reward.overlap", "= true would be ignored: the masked trainer scores each iteration's "
                                                 "samples in one call after sampling, so there is nothing to overlap")
        own = {f"{section}.{k}" for section, keys in getattr(world, "OWN_KEYS", {}).items() for k in keys}
        for kind in MASKED_KINDS:  # a key only another world reads, set here, would be ignored
            for section, keys in getattr(world_file(kind), "OWN_KEYS", {}).items():
                for key in set_keys(getattr(self, section), keys):
                    if f"{section}.{key}" not in own:
                        raise config_error(f"{section}.{key}", f"is a key of model.kind={kind} and would be ignored by "
                                                               f"model.kind={self.model.kind}; remove it")
        if hasattr(world, "check_config"):  # the world's own needs (difrl/worlds/<its file>.check_config)
            world.check_config(self)


def load_masked_config(path, overrides=()) -> MaskedConfig:
    return load_config(MaskedConfig, path, overrides)


__all__ = ["MASKED_KINDS", "MaskedConfig", "load_masked_config"]
