"""Qwen-Image-Edit (`QwenImageEditPipeline`): Qwen-Image's transformer editing a source image given with each prompt.

    from difrl.models.diffusers_base import ImagePrompt
    policy = load_flow_policy("qwenimage_edit", "/models/Qwen-Image-Edit", dtype="bf16", height=512, width=512)
    cond = policy.encode([ImagePrompt("make the sky red", "photos/beach.png")])   # what the edit world passes

Prompts: each is an `ImagePrompt` (difrl/models/diffusers_base.py), a str (the instruction: what rewards read) carrying
its source image's path; the diffusers world makes them from model.prompt_file's records {"prompt": ..., "image": ...}
(difrl/worlds/diffusers.py). A plain str is refused. Conditions stay tensors of the rows, so everything downstream of
`encode` (rollouts, the prompt cache, re-scoring, FSDP) is Qwen-Image's.

The source image, as the pipeline's `__call__` takes it: resized to about `source_size`^2 pixels at its aspect ratio,
sides multiples of 32 (`calculate_dimensions`; the pipeline's area is 1024^2, the default; Flow-Factory trains its edit
models at 384), then (a) through the processor into Qwen2.5-VL: its vision tokens sit in the edit chat template, whose
64-token system part is dropped (`prompt_template_encode_start_idx`); (b) through the VAE: its latent distribution's
mode, normalised with latents_mean / latents_std, packed to cond["image_latents"] [B, Ls, 4 z_dim]. The transformer sees
[noisy latents; image latents] along the sequence with img_shapes [(1, h, w) of the target, (1, hs, ws) of the source];
the velocity is its first L tokens (the target's). All of a policy's sources must resolve to one size (conditions of any
rows concatenate): one of another aspect ratio is refused, naming it (crop the set to one ratio).

Guidance: Qwen-Image's true CFG with the norm rescale (`guidance` = the pipeline's `true_cfg_scale`); the pipeline reads
the negative prompt with each row's source image, so cond carries those rows too (negative_prompt_embeds, _mask), and
`uncond` returns them. Text: each row zero-padded to its image's vision tokens (+ 2 markers) + max_sequence_length (the
instruction's tokens) + 5 (the template's end) with a mask (Qwen-Image's static shapes); the pipeline never truncates an
instruction, this cuts one longer than max_sequence_length tokens (noted once). Latent shape and timesteps:
Qwen-Image's (qwenimage.py).
"""

from __future__ import annotations

import torch

from difrl.models.base import Cond
from difrl.models.diffusers_base import ImagePrompt
from difrl.models.qwenimage import QwenImagePolicy, real_tokens


def _vision_indices_on_host(visual, args, kwargs):
    """The vision tower's index bookkeeping (patch positions, attention and window boundaries, the window order),
    computed from the image grid [n_images, 3] by transformers' own helpers before the tower runs, which then takes
    them precomputed (transformers.vision_utils: each helper pops its key from the forward's kwargs): the same values,
    made as real host tensors also under difrl plan's fake-tensor simulation, where the tower's aranges would be
    simulated and its `index[index != -100]` could not be sized (no-op otherwise; transformers without vision_utils:
    the tower computes them itself)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        from transformers import vision_utils as vu
    except ImportError:
        return None
    grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
    if grid is None or "window_index" in kwargs:
        return None
    with unset_fake_temporarily():
        window_index, cu_window_seqlens = vu.get_vision_window_index(
            grid, spatial_merge_size=visual.spatial_merge_size, window_size=visual.window_size,
            patch_size=visual.patch_size)
        extra = {"position_ids": vu.get_vision_position_ids(grid, visual.spatial_merge_size),
                 "cu_seqlens": vu.get_vision_cu_seqlens(grid), "window_index": window_index,
                 "cu_window_seqlens": cu_window_seqlens}
    return args, {**kwargs, **extra}


class QwenImageEditPolicy(QwenImagePolicy):
    """Qwen-Image-Edit (`QwenImageEditPipeline`): Qwen-Image with a source image per prompt (ImagePrompt)."""

    kind = "qwenimage_edit"
    pipeline_class = "QwenImageEditPipeline"
    accepted_classes = ("QwenImageEditPipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "processor", "scheduler")
    model_options = ("source_size",)
    source_images = True

    def __init__(self, pipe, *, source_size: int = 1024, **options):
        super().__init__(pipe, **options)
        self.source_size = int(source_size)
        if self.source_size < 32:
            raise ValueError(f"source_size={source_size}: the source image's side must be at least 32 pixels")
        self._source_hw: tuple[int, int] | None = None  # (h, w) every source of this policy resizes to
        self._source_by: str | None = None  # the image that set it (named when another size is refused)
        for m in pipe.text_encoder.modules():  # Qwen2.5-VL's vision tower
            if type(m).__name__ == "Qwen2_5_VisionTransformerPretrainedModel":
                m.register_forward_pre_hook(_vision_indices_on_host, with_kwargs=True)

    def source_hw(self, size: tuple[int, int]) -> tuple[int, int]:
        """(h, w) a source image of PIL `size` (w, h) is resized to: the pipeline's calculate_dimensions on the area
        source_size^2 and its aspect ratio."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit

        w, h, _ = edit.calculate_dimensions(self.source_size ** 2, size[0] / size[1])
        if min(w, h) <= 0:
            raise ValueError(f"a {size[0]}x{size[1]} source resizes to a side of 0 pixels at source_size="
                             f"{self.source_size} (sides are rounded to multiples of 32): raise model.source_size")
        return int(h), int(w)

    def check_sources(self, prompts: list) -> None:
        """Refuse, naming it, a prompt that is no ImagePrompt or whose source image does not open or resizes to
        another size than the others (reads the images' headers only: the world calls it on its whole prompt set)."""
        self._sources(prompts, resize=False)

    def _sources(self, prompts: list, resize: bool = True) -> list:
        """The source images of `prompts` resized as the pipeline does (PIL, one (h, w) for all)."""
        from PIL import Image

        bad = [p for p in prompts if not isinstance(p, ImagePrompt)]
        if bad:
            raise ValueError(f"{self.kind} edits a source image: each prompt must be an ImagePrompt(text, image path) "
                             "(the diffusers world makes them from model.prompt_file's .jsonl records {\"prompt\": ..., "
                             f"\"image\": ...}}); got the plain prompt {str(bad[0])!r}")
        out = []
        for p in prompts:
            try:
                with Image.open(p.image) as f:
                    size, img = f.size, f.convert("RGB") if resize else None
            except (OSError, ValueError) as e:
                raise ValueError(f"the source image {p.image} of prompt {str(p)!r} does not open as an image: {e}") from e
            hw = self.source_hw(size)
            if self._source_hw is None:
                self._source_hw, self._source_by = hw, p.image
            elif hw != self._source_hw:
                raise ValueError(f"the source image {p.image} ({size[0]}x{size[1]}) resizes to {hw[1]}x{hw[0]}, "
                                 f"but {self._source_by} to {self._source_hw[1]}x{self._source_hw[0]}: every source of "
                                 "a run must have one aspect ratio (its conditions concatenate); crop them alike")
            out.append(self.pipe.image_processor.resize(img, *hw) if resize else None)
        return out

    def _embed(self, texts: list[str], images: list, key: str) -> Cond:
        """QwenImageEditPipeline._get_qwen_prompt_embeds of `texts` with `images`, with static shapes (real_tokens):
        {key: [B, n_vision + 2 + max_sequence_length + 5, D], key + "_mask": [B, same] long}."""
        pipe = self.pipe
        inputs = pipe.processor(text=[pipe.prompt_template_encode.format(t) for t in texts], images=images,
                                padding=True, return_tensors="pt").to(self.device)
        hidden = pipe.text_encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                   pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                                   output_hidden_states=True).hidden_states[-1]  # [B, T, D]
        # the kept part: <|vision_start|>, the image's tokens, <|vision_end|>, the instruction, the template's end
        vision = int((inputs["input_ids"][0] == pipe.processor.image_token_id).sum()) + 2
        end = len(pipe.tokenizer(pipe.prompt_template_encode.split("{}")[1])["input_ids"])  # 5: <|im_end|>\n...assistant\n
        embeds, mask = real_tokens(hidden, inputs["attention_mask"], pipe.prompt_template_encode_start_idx,
                                   vision + self.max_sequence_length + end)
        return {key: embeds.to(pipe.text_encoder.dtype), key + "_mask": mask}

    def _encode_batch(self, prompts: list) -> Cond:
        """The instruction's and the negative prompt's embeddings, each read with the row's source image, and the
        source's packed VAE latents [B, Ls, 4 z_dim] (the pipeline's prepare_latents)."""
        pipe = self.pipe
        images = self._sources(prompts)
        cond = {**self._embed([str(p) for p in prompts], images, "prompt_embeds"),
                **self._embed([self.negative_prompt] * len(prompts), images, "negative_prompt_embeds")}
        h, w = self._source_hw
        pixels = torch.cat([pipe.image_processor.preprocess(img, h, w) for img in images])  # [B, 3, h, w] in [-1, 1]
        z = pipe._encode_vae_image(pixels[:, :, None].to(pipe.vae.device, pipe.vae.dtype), generator=None)  # mode
        cond["image_latents"] = self.pack(z[:, :, 0]).to(pipe.text_encoder.dtype)  # [B, Ls, 4 z_dim]
        return cond

    def uncond(self, cond: Cond, batch: int) -> Cond:
        """The rows' negative prompt read with their own source images (encoded with the prompts)."""
        return {**cond, "prompt_embeds": cond["negative_prompt_embeds"],
                "prompt_embeds_mask": cond["negative_prompt_embeds_mask"]}

    def _forward(self, x, sigma, cond, guidance):
        self._check_batch(cond, x.shape[0])
        if self._source_hw is None:
            raise ValueError("this condition was not encoded by this policy (no source image seen yet): encode first")
        dt, vsf = self.dtype, self.pipe.vae_scale_factor
        source = (1, self._source_hw[0] // vsf // 2, self._source_hw[1] // vsf // 2)  # the pipeline's second img_shape
        out = self.module(
            hidden_states=torch.cat([x.to(dt), cond["image_latents"].to(dt)], dim=1),  # [B, L + Ls, 4 z_dim]
            timestep=(sigma * 1000).to(dt) / 1000,
            encoder_hidden_states=cond["prompt_embeds"].to(dt),
            encoder_hidden_states_mask=cond["prompt_embeds_mask"],
            img_shapes=[[self.img_shape, source]] * x.shape[0],
            return_dict=False,
        )[0]
        return out[:, :x.shape[1]]  # the target's tokens

    @staticmethod
    def tiny_pipeline():
        """Qwen-Image's tiny transformer, VAE (vae_scale_factor 4) and scheduler (qwenimage.py) with a 2-layer
        Qwen2.5-VL of width 32 whose 1-block vision tower reads the source image, a byte-level Qwen2 tokenizer whose
        edit-template system part is the real 64 tokens, and a Qwen2VLProcessor resizing images to 56 x 56 (4 image
        tokens). Use source_size=32 with it: 32 x 32 sources, 16 latent tokens (the default 1024 costs seconds)."""
        import diffusers
        from transformers import Qwen2_5_VLForConditionalGeneration

        from difrl.models.tiny import (QWEN_EDIT_TEMPLATE_WORDS, tiny_qwen2_tokenizer, tiny_qwen2vl_processor,
                                    tiny_qwen25_vl_config)

        tok = tiny_qwen2_tokenizer(QWEN_EDIT_TEMPLATE_WORDS)
        text = tiny_qwen25_vl_config(tok)
        base = QwenImagePolicy.tiny_pipeline()  # its transformer, VAE and scheduler
        return diffusers.QwenImageEditPipeline(
            transformer=base.transformer, vae=base.vae, scheduler=base.scheduler,
            text_encoder=Qwen2_5_VLForConditionalGeneration(text), tokenizer=tok,
            processor=tiny_qwen2vl_processor(tok))
