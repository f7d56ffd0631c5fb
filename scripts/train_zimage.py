"""Train Z-Image (a local ZImagePipeline directory) with difrl's flow trainer, the same one as `difrl train`.

    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 scripts/train_zimage.py configs/zimage_flow_grpo.yaml model.path=/models/Z-Image model.prompt_file=/data/prompts.txt
    python scripts/make_tiny_pipeline.py zimage runs/tiny_zimage && python scripts/train_zimage.py configs/zimage_tiny.yaml

Everything else is the config: configs/zimage_flow_grpo.yaml carries Flow-Factory's Z-Image GRPO recipe (full
fine-tuning, sized for 8 GPUs: on P, train.grad_accum = 384 / P keeps its 2 updates per rollout; the start-up error
says so). sampler.guidance is the pipeline's guidance_scale: 0 is one forward per step (Z-Image-Turbo), any value
above 0 classifier-free guidance. `resume=DIR` alone (no config file) continues the run in DIR with its config.yaml; a
run of several processes continues under the launch that started it, `resume=DIR` in place of train_zimage.py's
arguments: the command a stopped run prints (difrl.train.run.interrupt). key=value overrides may follow --out.
"""

from difrl.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main("zimage", description=__doc__))
