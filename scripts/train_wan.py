"""Train Wan 2.1 text-to-video (a local WanPipeline directory) with difrl's flow trainer, the same one as `difrl train`.

    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_wan.py configs/wan_dance_grpo.yaml model.path=/models/Wan2.1-T2V-1.3B-Diffusers model.prompt_file=prompts.txt train.grad_accum=24
    python scripts/train_wan.py configs/wan_dance_grpo.yaml model.path=... train.grad_accum=192          # one process
    python scripts/make_tiny_pipeline.py wan runs/tiny_wan && python scripts/train_wan.py configs/flux_tiny.yaml model.kind=wan model.path=runs/tiny_wan model.num_frames=5 sampler.guidance=1 out=runs/wan_tiny_run

Videos are written as GIF grids in the run directory's samples/. Everything else is the config (configs/wan_dance_grpo.yaml
is sized for 16 GPUs: on P, train.grad_accum = 192 / P keeps its one update per rollout; the start-up error says so).
`resume=DIR` alone (no config file) continues the run in DIR with its config.yaml; a run of several processes
continues under the launch that started it, `resume=DIR` in place of train_wan.py's arguments: the command a stopped
run prints (difrl.train.run.interrupt). key=value overrides may follow --out.
"""

from difrl.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main("wan", description=__doc__))
