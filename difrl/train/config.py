"""The trainers' typed configs: every key, its default, its range (``difrl config`` lists them).

    cfg = load_flow_config("configs/digits.yaml", ["sampler.kind=cps"])  # a flow config, whatever it says
    cfg = load_train_config("configs/sudoku.yaml")    # FlowConfig or MaskedConfig by model.kind: difrl.train.recipes

One base (``TrainerConfig``) holds what every trainer has, defined once: the run keys (seed, threads, out,
resume, resume_override, resume_unverified, checkpoint_every, log_with, history) and the sections ``reward``,
``advantage``, ``train`` (common keys; ``FlowTrainConfig`` / ``MaskedTrainConfig`` add their own), ``eval`` and ``model``
(``kind``, ``path``). A trainer's config sets its own defaults through the section's default
instance (``MaskedConfig.train`` starts from lr 1e-4, clip 0.2, LoRA off). The trainer is chosen
from the typed ``model.kind`` (``difrl.train.recipes.load_train_config``): the flow kinds come from the world table
(difrl.worlds.flow_kinds(): plug-in model families too), the masked ones from difrl.worlds.MASKED_WORLDS.

Flow defaults follow Flow-GRPO (docs/reference/specs/flow-grpo-family.md §2.8, §8.7) where they carry over to a model
of this size; the digits YAML sets what the bundled demo needs. The masked sections are in
difrl/train/masked/config.py, the evaluation sections (``eval``, ``stop``) in difrl/train/eval_config.py, the flow
methods' sections (``solrl``, ``tree``, ``nft``, ``matching``, ``awm``, ``dpo``, ``dgpo``, ``dppo``, ``draft``,
``refl``, ``gardo``, ``pref``) in
difrl/train/method_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

from difrl.config import cfg_field, config_error, load_config
from difrl.correct import METHODS, POLICY_LOSSES, option_problems
from difrl.models.adapters import HOW_TO_ADD
from difrl.quant.formats import FORMATS as QUANT_FORMATS
from difrl.quant.linear import BACKENDS as QUANT_BACKENDS
from difrl.train.eval_config import EvalConfig, FidConfig, FlowEvalConfig, StopConfig  # noqa: F401  (re-exported)
from difrl.train.method_checks import check_methods
from difrl.train.method_config import (LOG_PROB_OBJECTIVES, MATCHING_OBJECTIVES, AWMConfig, DGPOConfig,  # noqa: F401
                                       DPOConfig, DPPOConfig, MatchingConfig, NFTConfig, SolRLConfig, TreeConfig,
                                       check_objective)
from difrl.train.method_config import DraftConfig, GardoConfig, PrefConfig, ReflConfig  # noqa: F401
from difrl.worlds import check_world_config, flow_kinds, train_kinds


# ---------------------------------------------------------------------------------- every trainer


@dataclass
class ModelConfig:
    """The policy's world; its kind also picks the trainer (flow: difrl.worlds.flow_kinds(), masked: MASKED_KINDS)."""
    kind: str = cfg_field("digits", choices=train_kinds, choices_hint=HOW_TO_ADD,
                          help="a flow world (digits, or a diffusers pipeline at model.path) or a masked one")
    path: str | None = cfg_field(None, help="checkpoint / pipeline directory; None = the world's bundled base")


@dataclass
class RewardConfig:
    """Rewards through the one registry (difrl.rewards): built-ins, `module:function`, `difrl.rewards` entry points."""
    weights: dict[str, float] | None = cfg_field(None, help="reward name -> weight; None = the world's own reward "
                                                            "(digits, digit_tokens: digit_prob; sudoku: sudoku_cells)")
    options: dict[str, dict] = cfg_field(default_factory=dict, help="reward name -> factory keyword options")
    aggregate: str = cfg_field("reward_sum", choices=("reward_sum", "advantage_sum"), help="multi-reward aggregation")
    on_error: str = cfg_field("stop", choices=("stop", "drop_group"), help="a reward that raises or is NaN/inf")
    max_failed_frac: float = cfg_field(0.1, ge=0.0, le=1.0,
                                       help="reward.on_error=drop_group: stop when more than this fraction of the run's "
                                            "samples failed (or every sample of one iteration did)")
    overlap: bool = cfg_field(False, help="score rollout chunks in a background thread while the next chunk samples "
                                          "(rollout.chunks > 1; the scores equal serial scoring)")
    timeout: float | None = cfg_field(900.0, gt=0.0,
                                      help="seconds one reward may take on one rollout chunk; a call still running then "
                                           "stops the run under every on_error (its thread cannot be cancelled). "
                                           "Above the remote reward's 600 s deadline, below gloo's 30 min collective "
                                           "timeout; null waits forever")

    def validate(self) -> None:
        if self.weights is not None and not self.weights:
            raise config_error("weights", "at least one reward is needed (or null for the world's own reward)")
        from difrl.rewards import unknown_reward

        for name in self.weights or ():
            if (problem := unknown_reward(name)) is not None:  # before any model loads or run directory is made
                raise config_error(f"weights.{name}", problem)


@dataclass
class AdvantageConfig:
    """Group-relative advantages (difrl.algos.group_advantages), groups keyed by explicit ids."""
    scale: str = cfg_field("std", choices=("std", "mean", "loo"),
                           help="std: (r - mean) / (std + eps) (GRPO, MaskGRPO); mean: r - mean (d1); loo: "
                                "leave-one-out r_i - mean of the others (coupled-GRPO)")
    std_scope: str = cfg_field("group", choices=("group", "global"), help="scale=std: std over the group or the whole batch")
    eps: float = cfg_field(1e-4, gt=0.0)
    clip: float = cfg_field(5.0, gt=0.0, help="advantage clip |A| <= clip")
    drop_zero_spread: bool = cfg_field(True, help="drop groups whose rewards are all equal (no signal)")


@dataclass
class LoraConfig:
    enabled: bool = cfg_field(True, help="LoRA via peft (False = full fine-tuning)")
    rank: int = cfg_field(16, ge=1)
    alpha: float = cfg_field(32.0, gt=0.0)
    targets: list[str] | None = cfg_field(None, help="module names; None = the adapter's lora_target_modules")
    init: str = cfg_field("gaussian", choices=("gaussian", "default"), help="peft init_lora_weights (B = 0 either way)")


@dataclass
class TrainConfig:
    """The optimisation keys every trainer has (FlowTrainConfig and MaskedTrainConfig add their own)."""
    iterations: int = cfg_field(100, ge=0, help="rollout rounds")
    lr: float = cfg_field(3e-4, gt=0.0)
    weight_decay: float = cfg_field(1e-4, ge=0.0)
    betas: tuple[float, float] = cfg_field((0.9, 0.999))
    adam_eps: float = cfg_field(1e-8, gt=0.0)
    max_grad_norm: float | None = cfg_field(1.0, gt=0.0)
    micro_batch: int = cfg_field(16, ge=1, help="work per forward/backward: masked trainer: sequences (the flow "
                                                "trainer's FlowTrainConfig counts transitions, or auto)")
    grad_accum: int = cfg_field(1, ge=1, help="micro-batches per optimizer update")
    clip_low: float = cfg_field(1e-4, ge=0.0, help="PPO clip below: rho >= 1 - clip_low")
    clip_high: float = cfg_field(1e-4, ge=0.0, help="PPO clip above: rho <= 1 + clip_high")
    kl_beta: float = cfg_field(0.0, ge=0.0, help="weight of the KL to the reference policy (the base model)")
    lora: LoraConfig = field(default_factory=LoraConfig)
    ratio_check: bool = cfg_field(True, help="stop if the first on-policy micro-step has ratio != 1 (with a rollout "
                                             "copy also against the sampler kernel's own evaluation of the policy)")
    ratio_tol: float = cfg_field(1e-6, gt=0.0)
    checkpoint_format: str = cfg_field("auto", choices=("auto", "sharded", "gathered"),
                                       help="sharded: each process writes its shards (torch.distributed.checkpoint; "
                                            "resumes on any number of processes; `difrl export RUN_DIR` writes the "
                                            "weights); gathered: full tensors from the main process; auto = sharded "
                                            "under FSDP, else gathered (a resumed run keeps the format it chose)")


CORRECT_METHODS = tuple(METHODS)  # the correctors that need only (log_prob, log_prob_rollout, mask)


@dataclass
class CorrectConfig:
    method: str = cfg_field("none", choices=CORRECT_METHODS,
                            help="IS correction of rollout/train mismatch (difrl.correct); token_* act per step, seq_* "
                                 "per trajectory; *_bn: verl's batch-normalised TIS (weights / their batch mean); "
                                 "k3_rs: K3 rejection, options {threshold, aggregate: token|sum|mean|max}")
    options: dict[str, float | str] = cfg_field(default_factory=dict, help="keyword options of the method, e.g. {cap: 2.0}")

    def validate(self) -> None:
        for k, problem in option_problems(self.method, METHODS[self.method], self.options,
                                          ("log_prob", "log_prob_rollout", "mask")):
            raise config_error(f"options.{k}", problem)


@dataclass
class TrainerConfig:
    """What every trainer's config has; `trainer` names the recipe that runs it (train_function)."""
    trainer: ClassVar[str] = ""
    seed: int = cfg_field(0)
    threads: int | None = cfg_field(None, ge=1, help="torch threads; None = OMP_NUM_THREADS when set, else this process's share of its cores")
    out: str | None = cfg_field(None, help="run directory (also --out)")
    resume: str | None = cfg_field(None, help="a run directory to continue with its own config.yaml (difrl.train.run.rundir: "
                                              "the keys that may change on resume)")
    resume_override: bool = cfg_field(False, help="resume: accept changed settings that change the algorithm (each "
                                                  "recorded in config.yaml's history)")
    resume_unverified: bool = cfg_field(False, help="resume: also load a checkpoint that has no manifest.json (its "
                                                    "bytes unverified); otherwise such a checkpoint counts as damaged "
                                                    "and the newest intact one is used")
    checkpoint_every: int = cfg_field(0, ge=0, help="iterations between checkpoints (0 = only at the end)")
    log_with: list[str] = cfg_field(default_factory=list, help="trackers beside metrics.jsonl (accelerate's): "
                                                               "tensorboard (RUN_DIR/tensorboard), wandb (if installed)")
    history: list[dict] = cfg_field(default_factory=list, help="written by the trainer: the settings each resume "
                                                             "changed, [{iteration, key, old, new}]")
    model: ModelConfig = field(default_factory=ModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> None:
        if self.resume_override and not self.resume:
            raise config_error("resume_override", "goes with resume=RUN_DIR (it accepts a resumed run's changed settings)")
        bad = [t for t in self.log_with if t not in TRACKERS]
        if bad:
            raise config_error("log_with", f"{bad}: not a tracker difrl starts; use {list(TRACKERS)}")


TRACKERS = ("tensorboard", "wandb")


def set_keys(section, names) -> list[str]:
    """The keys among `names` whose value in the config section differs from the section class's default: the
    ones a user set. validate() uses it to refuse a key that this configuration would silently ignore (a key
    left at, or set to, its default changes nothing, and a saved config.yaml, which lists every key, still
    loads)."""
    default = type(section)()
    return [n for n in names if getattr(section, n) != getattr(default, n)]


def refuse_ignored(section, prefix: str, names, why: str) -> None:
    """A located ConfigError for the first of `names` set in `section` (set_keys: differs from its default) that this
    configuration would silently ignore; `why` says why."""
    for key in set_keys(section, names):
        raise config_error(f"{prefix}.{key}", f"= {getattr(section, key)!r} would be ignored: {why}; remove the key "
                                              f"or set it to its default {getattr(type(section)(), key)!r}")


# ---------------------------------------------------------------------------------- the flow trainer


@dataclass
class FlowModelConfig(ModelConfig):
    """The policy: the bundled digits world, or a diffusers pipeline directory (flux, sd3, wan; difrl/worlds/diffusers.py)."""
    kind: str = cfg_field("digits", choices=flow_kinds, choices_hint=HOW_TO_ADD,
                          help="digits world, or a diffusers pipeline at model.path (FLUX.1 / SD3 / Wan 2.1, or a "
                               "registered family)")
    prompts: list[str] | None = cfg_field(None, help="diffusers models: training prompts (or model.prompt_file)")
    prompt_file: str | None = cfg_field(None, help="diffusers models: training prompts, one per line, or a .jsonl "
                                                                  "file of {\"prompt\": ..., <metadata>} objects (GenEval, OCR sets)")
    eval_prompts: list[str] | None = cfg_field(None, help="diffusers models: evaluation prompts; None = the first 8 "
                                                          "training prompts")
    eval_prompt_file: str | None = cfg_field(None, help="diffusers models: held-out evaluation prompts from a file (text "
                                                        "or .jsonl with metadata: GenEval, OCR sets); wins over "
                                                        "eval_prompts")
    height: int = cfg_field(512, ge=8, help="diffusers models: image / video height")
    width: int = cfg_field(512, ge=8, help="diffusers models: image / video width")
    num_frames: int = cfg_field(33, ge=1, help="wan: frames per video (4k + 1)")
    guidance_scale_2: float | None = cfg_field(None, help="wan22 A14B: the low-noise expert's CFG scale (WanPipeline's "
                                                          "guidance_scale_2); None: sampler.guidance")
    train_experts: str = cfg_field("both", choices=("both", "high", "low"), help="wan22 A14B: the experts trained")
    source_size: int = cfg_field(1024, ge=32, help="qwenimage_edit: source images are resized to about source_size^2 "
                                                   "pixels at their aspect ratio (the pipeline: 1024)")
    dtype: str = cfg_field("fp32", choices=("fp32", "bf16", "fp16"),
                           help="diffusers models: transformer and text-encoder dtype (step math stays fp32)")
    schedule: str = cfg_field("pipeline", choices=("pipeline", "shift"),
                              help="diffusers models: the pipeline scheduler's own sigmas (FLUX: dynamic shift) or "
                                   "difrl's static sigma_schedule(num_steps, sampler.shift) (DanceGRPO's FLUX schedule)")
    max_sequence_length: int = cfg_field(512, ge=1, help="diffusers models: T5 / UMT5 prompt tokens (SD3: 256)")
    negative_prompt: str = cfg_field("", help="sd3, wan (guidance > 1): the CFG negative prompt")
    cache_prompts: bool = cfg_field(True, help="diffusers models: embed each prompt once (the text encoders are frozen)")
    offload_text_encoders: bool = cfg_field(False, help="diffusers models: keep the text encoders on the CPU; each batch "
                                                        "of prompts not yet embedded moves them to the GPU and back "
                                                        "(with cache_prompts, every prompt is embedded once)")
    gradient_checkpointing: bool = cfg_field(False, help="diffusers models: recompute each transformer block's "
                                                         "activations in the backward (less memory, ~1/3 more update "
                                                         "compute; rollouts unaffected)")
    compile: bool = cfg_field(False, help="diffusers models: torch.compile each repeated transformer block (regional "
                                          "compilation; the first iterations pay the compile time)")


@dataclass
class SamplerConfig:
    kind: str = cfg_field("flow_sde", choices=("flow_sde", "dance_sde", "cps"), help="stochastic step kernel")
    num_steps: int = cfg_field(10, ge=1, help="denoising steps of a rollout")
    shift: float = cfg_field(1.0, gt=0.0, help="static time shift of the sigma schedule")
    noise_level: float = cfg_field(0.7, ge=0.0, help="a (flow_sde, cps) or eta (dance_sde)")
    guidance: float = cfg_field(1.0, ge=0.0, help="classifier-free guidance scale in rollout and training (1 = off; zimage: the "
                                                   "pipeline's guidance_scale, 0 = off)")
    log_prob_reduce: str = cfg_field("mean", choices=("mean", "sum"), help="per-element mean (published clip ranges) or sum")
    cps_log_prob: str = cfg_field("gaussian", choices=("gaussian", "flow_grpo"), help="CPS log-prob: true Gaussian or Flow-GRPO's unnormalised")
    rollout_batch: int | None = cfg_field(None, ge=1, help="model forward batch in rollouts (None = all samples)")

    def kernel_kwargs(self) -> dict:
        """The step kernel's keyword arguments (difrl.samplers.KERNELS[kind]): the one place they are built."""
        kw = {"noise_level": self.noise_level, "reduce": self.log_prob_reduce}
        if self.kind == "cps":
            kw["log_prob_form"] = self.cps_log_prob
        return kw


@dataclass
class StepsConfig:
    """Which steps are stochastic and trained; all others are ODE steps."""
    mode: str = cfg_field("all_but_last", choices=("all_but_last", "fixed_window", "random_window", "sliding_window", "random_subset"),
                          help="Flow-GRPO / fixed window / Flow-GRPO-Fast / MixGRPO / DanceGRPO")
    window_size: int = cfg_field(3, ge=1, help="window length (window modes)")
    window_start: int = cfg_field(0, ge=0, help="fixed_window start; sliding_window first start")
    window_range: tuple[int, int] | None = cfg_field(None, help="random_window: window lies in [lo, hi); None = first half")
    advance_every: int = cfg_field(25, ge=1, help="sliding_window: iterations per window position (MixGRPO tau)")
    stride: int = cfg_field(1, ge=0, help="sliding_window: steps the window moves each time")
    roll_back: bool = cfg_field(True, help="sliding_window: restart from the first position after the last")
    fraction: float = cfg_field(0.6, gt=0.0, le=1.0, help="random_subset: trained fraction of the first N-1 steps (DanceGRPO tau)")


@dataclass
class RolloutConfig:
    kind: str = cfg_field("flat", choices=("flat", "solrl", "tree"),
                          help="flat: roll out the trained samples directly; solrl: rank a low-precision candidate pool, "
                               "regenerate the chosen seeds at full precision (section solrl); tree: BranchGRPO, one "
                               "branching tree per prompt whose leaves are the group (section tree)")
    prompts_per_iter: int = cfg_field(10, ge=1, help="groups (prompts) per iteration, all processes together")
    group_size: int = cfg_field(16, ge=2, help="trained samples per prompt")
    same_init_noise: bool = cfg_field(False, help="one initial noise per group (diversity from SDE noise only)")
    chunks: int = cfg_field(1, ge=1, help="flat rollouts: sample each process's samples in this many sequential chunks; "
                                          "with reward.overlap, chunk k is decoded and scored while chunk k + 1 samples")
    precision: str = cfg_field("fp32", choices=("fp32",) + QUANT_FORMATS,
                               help="the rollout copy's format (difrl.quant: weights and linear-layer inputs). flat: the "
                                    "trained rollouts come from it (a mismatch; the trainer recomputes the proximal "
                                    "log-probs); solrl: the stage-1 candidates do. fp32 = no copy")
    sync_every: int = cfg_field(1, ge=1, help="refresh the rollout copy from the policy every this many iterations; > 1 "
                                              "rolls out from a stale copy (asynchronous RL; any rollout.precision)")
    fsdp_gather: str = cfg_field("auto", choices=("auto", "once", "per_forward"),
                                 help="under FSDP2, the trained rollouts' all-gathers: once = every block gathered once "
                                      "per rollout (least communication; the model in bf16 on each GPU while it "
                                      "samples), per_forward = before each forward (least memory), auto = once when "
                                      "that fits half the GPU's free memory (difrl/train/dist/unit_gather.py)")
    quant_skip: list[str] | None = cfg_field(None, help="linear layers kept exact (name substrings); None = the model's preset")
    quant_min_dim: int | None = cfg_field(None, ge=0, help="keep layers with max(in, out) <= this exact; None = preset")
    quant_backend: str = cfg_field("auto", choices=QUANT_BACKENDS,
                                   help="te = Transformer Engine, torch = torch._scaled_mm for fp8 / fp8_row (both an "
                                        "error if unusable), emulate = the exact pure-torch emulation (slower than BF16 "
                                        "on a GPU), auto = TE where it supports the format, else torch on a CUDA GPU "
                                        "with compute capability >= 8.9, else the emulation (always on CPU)")


@dataclass
class FlowTrainConfig(TrainConfig):
    micro_batch: int | Literal["auto"] = cfg_field(
        16, ge=1, help="transitions (sample-steps) per forward/backward, the same unit for flat, tree and solrl "
                       "rollouts; auto = whole samples, each process's samples cut into train.updates_per_epoch x "
                       "train.grad_accum micro-batches whatever the trained steps and processes (trees: their edges)")
    updates_per_epoch: int | None = cfg_field(None, ge=1, help="optimizer updates per pass over the rollout: what "
                                                                "micro_batch=auto keeps (None = 1); with an explicit "
                                                                "micro_batch a check that it gives this many")
    inner_epochs: int = cfg_field(1, ge=1, help="passes over each rollout")
    kl_form: str = cfg_field("flow_grpo", choices=("flow_grpo", "exact"))
    ratio_norm: bool = cfg_field(False, help="GRPO-Guard RatioNorm: per-sample, per-step re-centred ratio (clip ~2e-6)")
    step_weight: str = cfg_field("none", choices=("none", "inverse_dt", "tempflow"),
                                 help="per-step loss weight: GRPO-Guard 1/dt, TempFlow 2.25 std, or none")
    ema_decay: float = cfg_field(0.0, ge=0.0, lt=1.0, help="EMA of trainable weights for eval/checkpoints (0 = off)")
    policy_loss: str = cfg_field("ppo_clip", choices=("ppo_clip",) + tuple(POLICY_LOSSES),
                                 help="objective=grpo: PPO-clip (train.clip_*), or difrl.correct's GSPO (sequence ratio), "
                                      "CTPO (cumulative ratio, position-scaled clip), ASPO (flipped weight for A > 0), "
                                      "VESPO (phi(W) kernel; with a rollout copy W includes pi_old / mu)")
    policy_loss_options: dict[str, float] = cfg_field(default_factory=dict, help="keyword options of policy_loss, e.g. "
                                                                                 "{eps_low: 3e-4, eps_high: 4e-4}")
    objective: str = cfg_field("grpo", choices=("grpo", "nft") + MATCHING_OBJECTIVES + ("dppo", "draft", "refl"),
                               help="grpo: PPO-clip on the SDE transitions' log-probs; nft: DiffusionNFT on clean samples "
                                    "(likelihood-free, deterministic rollouts; section nft); awm / dpo / dgpo / dppo / "
                                    "draft / refl: docs/guides/methods.md (their sections)")


@dataclass
class FlowConfig(TrainerConfig):
    trainer: ClassVar[str] = "flow"
    model: FlowModelConfig = field(default_factory=FlowModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    steps: StepsConfig = field(default_factory=StepsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: FlowTrainConfig = field(default_factory=FlowTrainConfig)
    correct: CorrectConfig = field(default_factory=CorrectConfig)
    solrl: SolRLConfig = field(default_factory=SolRLConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    matching: MatchingConfig = field(default_factory=MatchingConfig)
    awm: AWMConfig = field(default_factory=AWMConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    dgpo: DGPOConfig = field(default_factory=DGPOConfig)
    dppo: DPPOConfig = field(default_factory=DPPOConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    refl: ReflConfig = field(default_factory=ReflConfig)
    gardo: GardoConfig = field(default_factory=GardoConfig)
    pref: PrefConfig = field(default_factory=PrefConfig)
    eval: FlowEvalConfig = field(default_factory=FlowEvalConfig)
    stop: StopConfig = field(default_factory=StopConfig)

    def validate(self) -> None:
        super().validate()
        n, s = self.sampler.num_steps, self.steps
        if s.mode in ("fixed_window", "sliding_window") and s.window_start + s.window_size > n - 1:
            raise config_error("steps.window_start", f"window [{s.window_start}, {s.window_start + s.window_size}) must fit "
                                                     f"in the first {n - 1} of {n} steps (the last step is never trained)")
        if s.mode == "random_window":
            lo, hi = s.window_range or (0, max(s.window_size, n // 2))
            if not (0 <= lo and lo + s.window_size <= hi <= n):
                raise config_error("steps.window_range", f"[{lo}, {hi}) cannot hold a window of {s.window_size} in {n} steps")
        if s.mode == "random_subset" and n < 2:
            raise config_error("steps.mode", "random_subset needs at least 2 steps")
        if self.train.ratio_norm and self.sampler.kind == "cps" and self.sampler.cps_log_prob != "gaussian":
            raise config_error("train.ratio_norm", "RatioNorm needs the Gaussian log-prob; set sampler.cps_log_prob=gaussian")
        r = self.rollout
        if self.correct.method != "none":
            if (r.precision == "fp32" and r.sync_every == 1) or r.kind == "solrl":
                raise config_error("correct.method", f"{self.correct.method} corrects a rollout/train mismatch, but the "
                                                     f"trained rollouts come from the trained policy itself (rollout.kind="
                                                     f"{r.kind}, rollout.precision={r.precision}, rollout.sync_every="
                                                     f"{r.sync_every}): every weight would be 1")
            if self.train.objective not in LOG_PROB_OBJECTIVES:
                raise config_error("correct.method", f"importance correction needs log-probs; train.objective="
                                                     f"{self.train.objective} has none")
        if r.kind == "solrl":
            if self.solrl.candidates < r.group_size:
                raise config_error("solrl.candidates", f"{self.solrl.candidates} candidates cannot give "
                                                       f"rollout.group_size={r.group_size} trained samples per prompt")
            if r.same_init_noise:
                raise config_error("rollout.same_init_noise", "Sol-RL selects samples by their initial noise; a shared "
                                                              "initial noise per group leaves nothing to select")
        if r.kind == "tree":
            sched = self.tree.schedule(n)
            if sched.split_steps and sched.split_steps[-1] > n - 1:
                raise config_error("tree.split_steps", f"split step {sched.split_steps[-1]} is outside the {n} steps")
            if sched.leaves * self.tree.roots != r.group_size:
                raise config_error("rollout.group_size", f"{self.tree.roots} tree(s) per prompt (tree.roots) of "
                                                         f"{len(sched.split_steps)} split(s) with factor {sched.factor} "
                                                         f"have {sched.leaves * self.tree.roots} leaves, but rollout."
                                                         f"group_size={r.group_size}: they must be equal")
            if self.train.objective != "grpo":
                raise config_error("rollout.kind", f"tree rollouts train their SDE edges' log-probs with PPO-clip "
                                                   f"(train.objective=grpo), not train.objective={self.train.objective}")
            if s.mode == "random_subset":
                raise config_error("steps.mode", "a tree trains every SDE edge; random_subset (per-sample steps) does "
                                                 "not apply; use all_but_last (BranchGRPO) or a window (BranchGRPO-Mix)")
            bad = [d for d in self.tree.depth_prune if not 1 <= d <= n]
            if bad:
                raise config_error("tree.depth_prune", f"depths {bad} are outside 1..{n} (a child of step i has depth i + 1)")
        t = self.train
        fn = POLICY_LOSSES.get(t.policy_loss)
        for k, problem in ([] if fn is None else option_problems(t.policy_loss, fn, t.policy_loss_options,
                                                                  ("log_prob", "log_prob_old", "advantages", "mask", "log_prob_rollout"))):
            raise config_error(f"train.policy_loss_options.{k}", problem)
        if fn is None and t.policy_loss_options:
            raise config_error("train.policy_loss_options", "ppo_clip takes none; its ranges are train.clip_low/high")
        if fn is not None and (t.objective != "grpo" or t.ratio_norm):
            raise config_error("train.policy_loss", f"{t.policy_loss} replaces PPO-clip on the log-prob ratio; it needs "
                                                    "train.objective=grpo and train.ratio_norm=false")
        if self.train.objective != "grpo" and (self.train.ratio_norm or self.train.step_weight != "none"):
            raise config_error("train.objective", f"GRPO-Guard options (train.ratio_norm, train.step_weight) act on "
                                                  f"PPO-clip's log-prob ratios; train.objective={self.train.objective} "
                                                  "has none to clip")
        if t.objective == "nft":
            refuse_ignored(t, "train", ("kl_beta", "clip_low", "clip_high", "kl_form"), "train.objective=nft has no "
                           "log-prob ratio to clip and no per-step Gaussian KL (DiffusionNFT's pull to the reference is "
                           "nft.ref_beta)")
        elif fn is not None:
            refuse_ignored(t, "train", ("clip_low", "clip_high"), f"train.policy_loss={t.policy_loss} clips (or "
                           "weighs) by its own train.policy_loss_options; train.clip_low/high are PPO-clip's ranges")
        elif t.kl_beta == 0:
            refuse_ignored(t, "train", ("kl_form",), "train.kl_beta=0 adds no KL term")
        if self.sampler.kind != "cps":
            refuse_ignored(self.sampler, "sampler", ("cps_log_prob",), f"sampler.kind={self.sampler.kind}: only the "
                           "cps kernel has that log-prob choice")
        if r.kind != "tree":
            refuse_ignored(self.tree, "tree", [f.name for f in fields(self.tree)], f"rollout.kind={r.kind}: the tree "
                           "section configures BranchGRPO's tree rollouts (rollout.kind=tree)")
        if r.kind == "tree" and r.chunks != 1:
            raise config_error("rollout.chunks", f"= {r.chunks} would be ignored: a tree rollout samples each "
                                                 "process's trees in one pass (chunks apply to flat and solrl "
                                                 "rollouts); set rollout.chunks=1")
        check_objective(self, refuse_ignored)  # awm / dpo / dgpo / dppo (difrl/train/method_config.py)
        check_methods(self, refuse_ignored)  # DRaFT / ReFL, GARDO, Pref-GRPO against the rest (difrl/train/method_checks.py)
        check_world_config(self)  # the world's own needs (difrl/worlds/<its file>.check_config)


def load_flow_config(path, overrides=()) -> FlowConfig:
    return load_config(FlowConfig, path, overrides)
