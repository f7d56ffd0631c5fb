"""Train FLUX.2 [klein] (a local Flux2KleinPipeline directory, e.g. FLUX.2-klein-base-9B) with difrl's flow trainer, the same one as `difrl train`.

    accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_flux2_klein.py configs/flux2_klein_flow_grpo.yaml model.path=/models/FLUX.2-klein-base-9B model.prompt_file=prompts.txt
    python scripts/train_flux2_klein.py configs/flux2_klein_flow_grpo.yaml model.path=/models/FLUX.2-klein-base-9B model.prompt_file=prompts.txt train.grad_accum=384  # one process
    python scripts/make_tiny_pipeline.py flux2_klein runs/tiny_flux2_klein && python scripts/train_flux2_klein.py configs/flux2_klein_tiny.yaml

Everything else is the config: configs/flux2_klein_flow_grpo.yaml carries the reference recipe's values (Flow-Factory's),
headed by its command; sized for 8 GPUs: on P, train.grad_accum = 384 / P keeps its 2 updates per rollout.
`resume=DIR` alone (no config file) continues the run in DIR with its config.yaml; a run of several processes
continues under the launch that started it, `resume=DIR` in place of train_flux2_klein.py's arguments: the command a stopped
run prints (difrl.train.run.interrupt). key=value overrides may follow --out.
"""

from difrl.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main("flux2_klein", description=__doc__))
