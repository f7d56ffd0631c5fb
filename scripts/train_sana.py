"""Train SANA (a local SanaPipeline directory) with difrl's flow trainer, the same one as `difrl train`.

    accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes 8 scripts/train_sana.py configs/sana_sol_rl.yaml model.path=/models/Sana_1600M_1024px_diffusers model.prompt_file=/data/prompts.txt
    python scripts/train_sana.py configs/sana_sol_rl.yaml model.path=... train.grad_accum=72          # one process
    python scripts/make_tiny_pipeline.py sana runs/tiny_sana && python scripts/train_sana.py configs/sana_tiny.yaml

Everything else is the config: configs/sana_sol_rl.yaml carries Sol-RL's SANA recipe, headed by its command (sized for
8 GPUs as Sol-RL's: on P, train.grad_accum = 72 / P keeps its one update per rollout; the start-up error says so).
`resume=DIR` alone (no config file) continues the run in DIR with its config.yaml; a run of several processes
continues under the launch that started it, `resume=DIR` in place of train_sana.py's arguments: the command a stopped
run prints (difrl.train.run.interrupt). key=value overrides may follow --out.
"""

from difrl.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main("sana", description=__doc__))
