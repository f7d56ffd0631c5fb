"""The masked-diffusion recipe (trainer.py): its iteration plan and its typed config."""
