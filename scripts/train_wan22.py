"""Train Wan 2.2 TI2V-5B text-to-video (a local WanPipeline directory with expand_timesteps) with difrl's flow trainer, the same one as `difrl train`.

    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_wan22.py configs/wan22_dance_grpo.yaml model.path=/models/Wan2.2-TI2V-5B-Diffusers model.prompt_file=prompts.txt train.grad_accum=24
    python scripts/train_wan22.py configs/wan22_dance_grpo.yaml model.path=... train.grad_accum=192          # one process
    python scripts/make_tiny_pipeline.py wan22 runs/tiny_wan22 && python scripts/train_wan22.py configs/wan22_tiny.yaml

Videos are written as GIF grids in the run directory's samples/. Everything else is the config (configs/wan22_dance_grpo.yaml
is sized for 16 GPUs: on P, train.grad_accum = 192 / P keeps its one update per rollout; the start-up error says so).
`resume=DIR` alone (no config file) continues the run in DIR with its config.yaml; a run of several processes
continues under the launch that started it, `resume=DIR` in place of train_wan22.py's arguments: the command a stopped
run prints (difrl.train.run.interrupt). key=value overrides may follow --out.
"""

from difrl.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main("wan22", description=__doc__))
