"""Train SD3 / SD3.5 (a local StableDiffusion3Pipeline directory) with difrl's flow trainer, the same one as `difrl train`.

    accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_sd3.py configs/sd3_flow_grpo.yaml model.path=/models/sd3.5-medium model.prompt_file=prompts.txt train.grad_accum=72
    accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_sd3.py configs/sd3_flow_grpo_fast.yaml model.path=... train.grad_accum=24
    python scripts/train_sd3.py configs/sd3_flow_grpo.yaml model.path=... train.grad_accum=576         # one process
    python scripts/make_tiny_pipeline.py sd3 runs/tiny_sd3 && python scripts/train_sd3.py configs/flux_tiny.yaml model.kind=sd3 model.path=runs/tiny_sd3 out=runs/sd3_tiny_run

Everything else is the config: configs/sd3_*.yaml carry the published defaults, each headed by its command (sized for
32 GPUs: on P, train.grad_accum = 576 / P (fast: 192 / P) keeps their 2 updates per rollout; the start-up error says so).
`resume=DIR` alone (no config file) continues the run in DIR with its config.yaml; a run of several processes
continues under the launch that started it, `resume=DIR` in place of train_sd3.py's arguments: the command a stopped
run prints (difrl.train.run.interrupt). key=value overrides may follow --out.
"""

from difrl.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main("sd3", description=__doc__))
