"""Train FLUX.1 (a local diffusers FluxPipeline directory) with difrl's flow trainer, the same one as `difrl train`.

    accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_flux.py configs/flux_flow_grpo.yaml model.path=/models/FLUX.1-dev model.prompt_file=prompts.txt train.grad_accum=24
    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_flux.py configs/flux_dance_grpo.yaml model.path=... train.grad_accum=24
    python scripts/train_flux.py configs/flux_mix_grpo.yaml model.path=... train.grad_accum=96          # one process
    python scripts/make_tiny_pipeline.py flux runs/tiny_flux && python scripts/train_flux.py configs/flux_tiny.yaml
    accelerate launch --multi_gpu --num_processes 2 scripts/train_flux.py configs/flux_tiny.yaml   # 2 CPU processes
    python scripts/train_flux.py resume=runs/flux_tiny train.iterations=120     # continue a run (its config.yaml)

Everything else is the config: configs/flux_*.yaml carry the published defaults, each headed by its command. The
GPU configs are sized for the number of GPUs in their header (8 here: ddp.yaml / fsdp.yaml's num_processes); on
another, train.grad_accum keeps their train.updates_per_epoch, and the start-up error names the value that does.
`resume=DIR` alone (no config file) continues the run in DIR with its config.yaml; a run of several processes
continues under the launch that started it, `resume=DIR` in place of train_flux.py's arguments: the command a stopped
run prints (difrl.train.run.interrupt). key=value overrides may follow --out.
"""

from difrl.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main("flux", description=__doc__))
