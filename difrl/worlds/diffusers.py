"""Worlds for diffusers pipeline directories (FLUX.1, SD3, Wan 2.1): the same trainer as the digits world.

    world = build_world("flux", "/models/FLUX.1-dev", cfg)   # cfg.model: prompts, size, dtype, schedule
    metrics, images = world.evaluate(world.policy, per_digit=4, num_steps=28, seed=1234)
    world.save_grid(images, run_dir / "samples" / "after.png")       # Wan: a GIF beside that name
    world.save_final(policy, net, lora, run_dir, write_merged)      # lora/ (pipe.load_lora_weights) or transformer/

The policy is `load_flow_policy(kind, model.path, ...)` (difrl/models/adapters.py), on this
process's GPU when there is one. Training prompts come from `model.prompts` or `model.prompt_file`
(one per line, or .jsonl with metadata); prompt id = index. An image-editing model (the adapter's `source_images`:
Qwen-Image-Edit) takes a .jsonl of {"prompt": ..., "image": <path relative to the file>} records: each prompt is an
ImagePrompt carrying its source image (difrl.models.diffusers_base), checked to open now; the rewards score the edited
images as any others (the record, "image" included, is their metadata). The evaluation is a fixed-seed ODE
rollout of `eval.per_digit` samples for each evaluation prompt, scored by the run's own rewards
(`reward.weights`): a mean weighted reward with its standard error over the samples (`reward_sem`;
the run's summary reports after - before against it, difrl.eval.metrics.change_over_noise) and each reward's mean. The evaluation panel
(difrl.eval.panel) adds `eval.rewards`, held-out rewards never trained on, as `heldout/<name>`, and
with `eval.fid.reference` the Fréchet distance / KID of the samples on a named extractor (`fd`,
`kid`, `fd_report` with its provenance). FD early stopping stays refused by the config here (it
watches the digits world's accuracy too).

`cfg` is read duck-typed (a FlowConfig from difrl/train/config.py; this layer imports nothing from
difrl.train). The attributes it reads:

- `cfg.model`: `dtype`, `height`, `width`, `max_sequence_length`, `negative_prompt`, `cache_prompts`,
  `offload_text_encoders` (text encoders on the CPU between embeddings), `prompts`, `prompt_file`, `eval_prompts`,
  `eval_prompt_file`, `schedule` ("pipeline" or "shift"),
  `gradient_checkpointing`, `compile` (regional torch.compile of the transformer blocks), and the adapter's own
  `model_options` (Wan: `num_frames`);
- `cfg.reward`: `weights` (name -> weight), `options` (name -> keyword arguments);
- `cfg.eval`: `rewards` (the held-out panel), `fid` (extractor, weights, reference, cache_dir, kid_subset_size);
- `cfg.sampler`: `guidance`, `rollout_batch` (None = the whole evaluation batch).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from pathlib import Path

import torch

from difrl.eval.panel import EvalPanel
from difrl.models.diffusers_base import ImagePrompt
from difrl.rewards import build_reward, reward_key, score_all
from difrl.rollout import rollout
from difrl.samplers.schedules import sigma_schedule
from difrl.utils.collectives import whole
from difrl.utils.rng import mix_seed
from difrl.worlds import World
from difrl.worlds.contract import FDRise

MAX_EVAL_PROMPTS = 8  # model.eval_prompts = None: the first this many training prompts


def read_prompts(mc, key: str = "model.prompt_file", sources: bool = False) -> tuple[list[str], list[dict]]:
    """(prompts, each prompt's metadata) from model.prompts, or model.prompt_file: a text file (one prompt per
    line, metadata {}) or a .jsonl file of objects with a "prompt" key, the rest of each object being its
    metadata (GenEval's evaluation_metadata.jsonl, an OCR set's {"prompt": ..., "text": ...}). `sources` (an editing
    model's world, the adapter's source_images): each record names its source image, "image": a path (relative: to the
    file's folder), and each prompt is an ImagePrompt carrying that file's path."""
    if sources and (mc.prompts is not None or Path(mc.prompt_file).suffix != ".jsonl"):
        raise ValueError(f"{key}: this model edits a source image per prompt: give a .jsonl file of "
                         "{\"prompt\": ..., \"image\": <path>} records (model.prompts cannot carry images)")
    if mc.prompts is not None:
        prompts, meta = [str(p) for p in mc.prompts], [{} for _ in mc.prompts]
        source = "model.prompts"
    else:
        path = Path(mc.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"{key} {path}: no such file (a text file, one prompt per line, or "
                                    "a .jsonl file of {\"prompt\": ..., <metadata>} objects)")
        source = f"{key} {path}"
        lines = [(n, ln.strip()) for n, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
        if path.suffix == ".jsonl":
            meta = []
            for n, ln in lines:
                try:
                    rec = json.loads(ln)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{source}, line {n}: not JSON ({e})") from e
                if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                    raise ValueError(f"{source}, line {n}: expected an object with a string \"prompt\"")
                if sources and not (isinstance(rec.get("image"), str) and (path.parent / rec["image"]).is_file()):
                    raise ValueError(f"{source}, line {n}: \"image\" must name the source image's file (relative to "
                                     f"{path.parent}); got {rec.get('image')!r}")
                meta.append(rec)
            prompts = [ImagePrompt(m["prompt"], path.parent / m["image"]) if sources else m["prompt"] for m in meta]
        else:
            prompts, meta = [ln for _, ln in lines], [{} for _ in lines]
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    return prompts, meta


def policy_device() -> str | None:
    """This process's GPU (LOCAL_RANK under accelerate launch / torchrun), or None for the CPU."""
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return None


def policy_options(kind: str, cfg) -> dict:
    """The adapter options of `cfg.model` (size, dtype, text length, the family's own model_options) for
    load_flow_policy / arch_flow_policy, on this process's GPU when there is one."""
    from difrl.models.adapters import adapter_class, model_kinds

    mc = cfg.model
    options = dict(dtype=mc.dtype, height=mc.height, width=mc.width, device=policy_device(),
                   max_sequence_length=mc.max_sequence_length, negative_prompt=mc.negative_prompt,
                   cache_prompts=mc.cache_prompts, offload_text_encoders=getattr(mc, "offload_text_encoders", False))
    extra = adapter_class(kind).model_options if kind in model_kinds() else ()  # unknown: load_flow_policy says so
    options.update({name: getattr(mc, name) for name in extra})
    return options


def flow_world(kind: str, model_path: str | None, cfg=None, policy=None) -> World:
    """The world of the diffusers pipeline directory `model_path` (model `kind`, a key of ADAPTERS), set up
    from `cfg` (see the module docstring for the attributes read). `policy`: an adapter already made (difrl plan's,
    built from architecture configs on fake tensors, difrl.models.arch) instead of the one loaded from model_path."""
    from PIL import Image

    from difrl.models.adapters import load_flow_policy
    from difrl.models.lora_io import save_lora
    from difrl.worlds.digits import image_grid

    if model_path is None and policy is None:
        raise ValueError(f"model.kind={kind} needs model.path: a local diffusers pipeline directory")
    if cfg is None:
        raise ValueError(f"model.kind={kind} needs the run's config (cfg.model's prompts and size, cfg.reward, "
                         "cfg.sampler): build_world(kind, path, cfg)")
    mc = cfg.model
    if policy is None:
        policy = load_flow_policy(kind, model_path, **policy_options(kind, cfg))
    if mc.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    if mc.compile:
        policy.compile_blocks()
    sources = policy.source_images  # an editing model: prompts carry their source images (ImagePrompt)
    prompts, prompt_meta = read_prompts(mc, sources=sources)
    meta_by_prompt = dict(zip(prompts, prompt_meta))
    eval_prompts = list(mc.eval_prompts) if mc.eval_prompts is not None else prompts[:MAX_EVAL_PROMPTS]
    if getattr(mc, "eval_prompt_file", None):  # held-out prompts with their own metadata (GenEval records, OCR text)
        eval_prompts, eval_meta = read_prompts(SimpleNamespace(prompts=None, prompt_file=mc.eval_prompt_file),
                                               "model.eval_prompt_file", sources)
        meta_by_prompt.update(zip(eval_prompts, eval_meta))
    check = getattr(policy, "check_sources", None)  # Qwen-Image-Edit: one size for every source image, said now
    if sources and check is not None:               # rather than at the first batch that mixes two
        check([*prompts, *eval_prompts])

    def sigmas(num_steps: int, shift: float) -> torch.Tensor:
        if mc.schedule == "pipeline":  # the scheduler's own shift (FLUX: dynamic, from the image sequence length)
            return policy.sigma_schedule(num_steps)
        return sigma_schedule(num_steps, shift)

    weights = {reward_key(name): w for name, w in cfg.reward.weights.items()}
    rewards: dict = {}  # built on first evaluation
    panel = EvalPanel(cfg.eval, (mc.height, mc.width), policy_device() or "cpu")  # held-out rewards, FD / KID

    @torch.no_grad()
    def evaluate(policy, per_digit=4, num_steps=10, seed=1234, shift=1.0, split=None):
        """Fixed-seed ODE samples, `per_digit` per evaluation prompt (prompt-major), scored by the run's rewards.
        `split` (n -> (rows, finish), difrl.utils.collectives.split_rows): this process samples its rows, finish
        gathers every process's images; the rewards and the panel score all of them."""
        if not rewards:
            rewards.update({n: build_reward(n, **cfg.reward.options.get(n, {})) for n in cfg.reward.weights})
        ids = torch.arange(len(eval_prompts)).repeat_interleave(per_digit)
        texts = [eval_prompts[i] for i in ids.tolist()]
        seeds = torch.tensor([mix_seed(seed, i) for i in range(len(texts))])
        rows, finish = (split or whole)(len(texts))  # equal rows on every process: equal forwards (FSDP)
        bs = cfg.sampler.rollout_batch or len(rows)
        images = []
        for sl in rows.split(bs):  # decode batch by batch: a video model's decoded batch is large
            batch = rollout(policy, [texts[i] for i in sl.tolist()], seeds[sl], sigmas(num_steps, shift), kernel="ode",
                            sde_mask=torch.zeros(num_steps, dtype=torch.bool), guidance=cfg.sampler.guidance)
            images.append(policy.decode(batch.x_final).cpu())
        images = finish(torch.cat(images))
        meta = [{**meta_by_prompt.get(t, {}), "prompt_id": int(i), "prompt": t} for i, t in zip(ids, texts)]
        scores = score_all(rewards, images, texts, meta, seeds, ids)
        total = sum(w * scores[n] for n, w in weights.items())  # [N] the weighted reward of each sample
        metrics = {"reward": float(total.mean()),
                   "reward_sem": float(total.std() / len(total) ** 0.5) if len(total) > 1 else 0.0,  # sampling noise
                   **{f"reward/{k}": float(v.mean()) for k, v in scores.items()},
                   **panel(images, texts, meta, seeds, ids),
                   "samples": len(texts), "num_steps": num_steps}
        return metrics, images

    def save_grid(images: torch.Tensor, path: Path) -> None:
        """One row per evaluation prompt. Images: a PNG; videos [N, F, 3, H, W]: a GIF of frame grids (path.gif)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        per = max(1, images.shape[0] // max(1, len(eval_prompts)))
        scale = max(1, 64 // images.shape[-2])  # tiny models' 32x32 images shown at 64 px
        if images.ndim == 4:
            Image.fromarray(image_grid(images, nrow=per, scale=scale)).save(path)
            return
        frames = [Image.fromarray(image_grid(images[:, f], nrow=per, scale=scale)) for f in range(images.shape[1])]
        frames[0].save(path.with_suffix(".gif"), save_all=True, append_images=frames[1:], duration=125, loop=0)

    def save_final(policy, net, lora: bool, out_dir: Path, write_merged) -> None:
        """lora/ for pipe.load_lora_weights, or the full fine-tune's transformer/ (a diffusers checkpoint like the
        base, FluxTransformer2DModel.from_pretrained)."""
        if lora:
            save_lora(policy, Path(out_dir) / "lora")
        else:
            net.save_pretrained(Path(out_dir) / "transformer")

    # FDRise: the best FD of eval.fid is kept in the run's state; stop.fd_rise itself is refused (check_config)
    return World(kind, policy, prompts, evaluate, save_grid, lambda pid: {**prompt_meta[pid], "prompt_id": pid, "prompt": prompts[pid]},
                 sigmas=sigmas, save_final=save_final, stop=FDRise(),
                 before_after=("fd",))  # eval.fid's Fréchet distance (when set) before the headline reward


def check_config(cfg) -> None:
    """What a diffusers world needs of a FlowConfig before anything loads: the pipeline directory, training
    prompts, a named reward (it has none of its own), a schedule the shift applies to; FD early stopping is the
    bundled worlds'."""
    from difrl.config import config_error

    mc = cfg.model
    if mc.path is None:
        raise config_error("model.path", f"model.kind={mc.kind} needs a local diffusers pipeline directory")
    if (mc.prompts is None) == (mc.prompt_file is None):
        raise config_error("model.prompts", f"model.kind={mc.kind} needs training prompts: give model.prompts "
                                            "or model.prompt_file (one of them)")
    from difrl.models.adapters import ADAPTERS

    family = ADAPTERS.get(mc.kind)  # an entry point's family is not imported for a check: its world says it
    if family is not None and family.source_images and (mc.prompts is not None or mc.eval_prompts is not None):
        key = "model.prompts" if mc.prompts is not None else "model.eval_prompts"
        raise config_error(key, f"model.kind={mc.kind} edits a source image per prompt: give model.prompt_file (and "
                                "model.eval_prompt_file), .jsonl files of {\"prompt\": ..., \"image\": <path>} records")
    if mc.schedule == "pipeline" and cfg.sampler.shift != 1.0:
        raise config_error("sampler.shift", "model.schedule=pipeline samples on the pipeline scheduler's own "
                                            "shift; set model.schedule=shift to use sampler.shift")
    if cfg.reward.weights is None:
        raise config_error("reward.weights", f"model.kind={mc.kind} has no reward of its own: name one, e.g. "
                                             "reward.weights={brightness: 1.0} or a module:function")
    if cfg.stop.fd_rise is not None:
        raise config_error("stop.fd_rise", "FD early stopping needs the digits world's features")

