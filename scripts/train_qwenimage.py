"""Train Qwen-Image (a local QwenImagePipeline directory) with difrl's flow trainer, the same one as `difrl train`.

    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 32 scripts/train_qwenimage.py configs/qwenimage_flow_grpo.yaml model.path=/models/Qwen-Image model.prompt_file=/data/prompts.txt
    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_qwenimage.py configs/qwenimage_flow_grpo.yaml model.path=/models/Qwen-Image model.prompt_file=prompts.txt train.grad_accum=16
    python scripts/make_tiny_pipeline.py qwenimage runs/tiny_qwenimage && python scripts/train_qwenimage.py configs/qwenimage_tiny.yaml

Everything else is the config: configs/qwenimage_flow_grpo.yaml carries Flow-GRPO's pickscore_qwenimage values, headed
by its command (sized for 32 GPUs: on P, train.grad_accum = 128 / P keeps its 2 updates per rollout, e.g. 16 on the 8
GPUs of accelerate/fsdp.yaml; the start-up error says so). `resume=DIR` alone (no config file) continues the run in DIR
with its config.yaml; a run of several processes continues under the launch that started it, `resume=DIR` in place of
train_qwenimage.py's arguments: the command a stopped run prints (difrl.train.run.interrupt). key=value overrides may
follow --out.
"""

from difrl.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main("qwenimage", description=__doc__))
