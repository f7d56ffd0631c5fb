"""SANA (`SanaPipeline`): a linear-attention DiT over DC-AE latents, Gemma-2 text embeddings with the pipeline's
complex human instruction prepended, true classifier-free guidance.

    policy = load_flow_policy("sana", "/models/Sana_1600M_1024px_diffusers", dtype="bf16", height=1024, width=1024)

Latent shape (one sample; vsf = the DC-AE's spatial scale factor, 32 for the real model): `(C, H // vsf, W // vsf)`,
e.g. (32, 32, 32) at 1024x1024. Timesteps: `1000 sigma * transformer.config.timestep_scale` (1.0 for SANA 1.0), as
the pipeline passes `t * timestep_scale`; the DC-AE decodes `latents / scaling_factor` (no shift factor).

Prompts: each prompt is encoded as `SanaPipeline.__call__` encodes it by default: lowercased, the pipeline's own
complex human instruction (its `__call__` default, read from its signature) prepended, the first token and the last
`max_sequence_length - 1` kept (SANA paper §3.1), with the attention mask the transformer's cross-attention takes.
The negative prompt (default "") is encoded without the instruction, as the pipeline does. `complex_human_instruction=`
(constructor, a list of lines; [] for none) replaces it, as the pipeline's argument of that name does.

Guidance: the base class's true CFG when `guidance > 1` (difrl/models/diffusers_base.py); Sol-RL trains and evaluates
SANA CFG-free (guidance 1.0, configs/sana_sol_rl.yaml).

Scheduler: the published checkpoints ship `DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0,
prediction_type="flow_prediction")`, a second-order multistep solver; difrl's samplers take one Euler (or SDE) step per
sigma, so `sigma_schedule` gives the sigmas of `FlowMatchEulerDiscreteScheduler(shift=flow_shift)`, SANA's own
"flow_euler" sampler and the deterministic `flow` solver Sol-RL rolls SANA out with. A rollout then equals the pipeline
with `pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)` (the conversion script's `flow-euler` choice, and
the tiny pipeline's scheduler) to float precision; against the DPM-Solver++ pipeline it is a different solver of the
same ODE.
"""

from __future__ import annotations

import functools
import inspect

import torch

from difrl.models.base import Cond
from difrl.models.diffusers_base import DiffusersFlowPolicy, as_dtype, check_pipeline_dir
from difrl.quant.linear import QUANT_PRESETS


@functools.lru_cache(maxsize=1)
def default_instruction() -> tuple[str, ...]:
    """SanaPipeline.__call__'s default `complex_human_instruction` (read from its signature, never copied)."""
    from diffusers import SanaPipeline

    return tuple(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default or ())


class SanaPolicy(DiffusersFlowPolicy):
    """SANA (`SanaPipeline`): linear-attention DiT, DC-AE latents, Gemma-2 embeddings, true CFG."""

    kind = "sana"
    pipeline_class = "SanaPipeline"
    accepted_classes = ("SanaPipeline",)
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    # Sol-RL's SANA targets (NVlabs/Sana configs/sol_rl/sana.py: attn.qkv, attn.proj, cross_attn.{q_linear, kv_linear,
    # proj}) under diffusers' names (huggingface/diffusers scripts/convert_sana_to_diffusers.py splits qkv and kv into
    # to_q / to_k / to_v)
    lora_candidates = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                       "attn2.to_v", "attn2.to_out.0")
    quant_preset = QUANT_PRESETS["sana"]  # Sol-RL's skip list, diffusers' names (difrl/quant/linear.py)
    block_classes = ("SanaTransformerBlock",)  # the repeated transformer blocks (regional compile, sharding)
    fsdp_fp32_inputs = ("timestep",)  # 1000 sigma: the pipeline passes it in fp32 and embeds it in fp32

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, negative_prompt: str = "",
                 max_sequence_length: int = 300, cache_prompts: bool = False,
                 complex_human_instruction: list[str] | tuple[str, ...] | None = None):
        super().__init__(pipe, height=height, width=width, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, cache_prompts=cache_prompts)
        self.complex_human_instruction = list(default_instruction() if complex_human_instruction is None
                                              else complex_human_instruction)
        vsf = pipe.vae_scale_factor  # 2 ** (len(encoder_block_out_channels) - 1): 32 for the real DC-AE
        self.latent_shape = (self.transformer_config.in_channels, self.height // vsf, self.width // vsf)

    @classmethod
    def from_pretrained(cls, path, dtype="fp32", height: int = 1024, width: int = 1024, device=None, **options):
        check_pipeline_dir(path, cls)
        return cls(cls._load_pipeline(path, as_dtype(dtype), device), height=height, width=width, **options)

    def _encode(self, prompts: list[str], instruction: list[str] | None) -> Cond:
        embeds, mask, _, _ = self.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=self.device,
                                                     max_sequence_length=self.max_sequence_length,
                                                     complex_human_instruction=instruction)
        # prompt_embeds [B, L, caption_channels], prompt_attention_mask [B, L] (1 = token, 0 = padding)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def _encode_batch(self, prompts: list[str]) -> Cond:
        return self._encode(prompts, self.complex_human_instruction)

    def negative_cond(self, batch: int) -> Cond:
        """The negative prompt's embeddings, encoded once without the instruction (as the pipeline's encode_prompt
        encodes its negative prompt), expanded to `batch` rows."""
        if self._negative is None:
            with torch.no_grad(), self.text_encoders_on_device():
                self._negative = self._encode([self.negative_prompt], None)
        return {k: v.expand(batch, *v.shape[1:]) for k, v in self._negative.items()}

    def _euler_scheduler(self):
        from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

        s = self.pipe.scheduler
        if isinstance(s, DPMSolverMultistepScheduler) and s.config.get("use_flow_sigmas", False):
            # the published checkpoints' flow DPM-Solver++: Euler steps over SANA's flow_euler sigmas (module docstring)
            return FlowMatchEulerDiscreteScheduler(num_train_timesteps=s.config.num_train_timesteps,
                                                   shift=s.config.flow_shift)
        return super()._euler_scheduler()

    def _forward(self, x, sigma, cond, guidance):
        self._check_batch(cond, x.shape[0])
        dt = self.dtype
        return self.module(hidden_states=x.to(dt), encoder_hidden_states=cond["prompt_embeds"].to(dt),
                           encoder_attention_mask=cond["prompt_attention_mask"],
                           timestep=sigma * 1000 * self.transformer_config.timestep_scale, return_dict=False)[0]

    def _vae_latents(self, latents):
        return latents / self.pipe.vae.config.scaling_factor

    @staticmethod
    def tiny_pipeline():
        """A 2-level DC-AE (vae_scale_factor 2, 4 latent channels; the real one has 6 levels, 32x, 32 channels), so
        32x32 images have 16x16 latents; one-layer Gemma-2 (width 32 = caption_channels) with a character-level
        Gemma tokenizer built in code; two SANA blocks; `FlowMatchEulerDiscreteScheduler(shift=3.0)`, the Euler form
        of the real checkpoints' flow DPM-Solver (module docstring)."""
        import diffusers
        from transformers import Gemma2Config, Gemma2Model

        from difrl.models.tiny import tiny_gemma_tokenizer

        tok = tiny_gemma_tokenizer()
        return diffusers.SanaPipeline(
            transformer=diffusers.SanaTransformer2DModel(
                in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=32,
                mlp_ratio=2.5, sample_size=16, patch_size=1),
            vae=diffusers.AutoencoderDC(
                in_channels=3, latent_channels=4, attention_head_dim=4, encoder_block_types=("ResBlock", "ResBlock"),
                decoder_block_types=("ResBlock", "ResBlock"), encoder_block_out_channels=(8, 8),
                decoder_block_out_channels=(8, 8), encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
                encoder_qkv_multiscales=((), ()), decoder_qkv_multiscales=((), ()), decoder_norm_types="rms_norm",
                decoder_act_fns="silu", scaling_factor=0.41407),
            text_encoder=Gemma2Model(Gemma2Config(
                vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, pad_token_id=0, bos_token_id=2,
                eos_token_id=1)),
            tokenizer=tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
