"""Train Qwen-Image-Edit (a local QwenImageEditPipeline directory) on an image-editing set with difrl's flow trainer, the
same one as `difrl train`.

    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 scripts/train_qwenimage_edit.py configs/qwenimage_edit_flow_grpo.yaml model.path=/models/Qwen-Image-Edit model.prompt_file=/data/edits/train.jsonl
    python scripts/make_tiny_pipeline.py qwenimage_edit runs/tiny_qwenimage_edit && python scripts/train_qwenimage_edit.py configs/qwenimage_edit_tiny.yaml

The prompt file is a .jsonl of {"prompt": <instruction>, "image": <source image, relative to the file>} records (the
rest of each record is reward metadata); the rewards score the edited images. Everything else is the config:
configs/qwenimage_edit_flow_grpo.yaml carries Flow-Factory's Qwen-Image-Edit GRPO values, headed by its command.
`resume=DIR` alone (no config file) continues the run in DIR with its config.yaml; key=value overrides may follow --out.
"""

from difrl.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main("qwenimage_edit", description=__doc__))
