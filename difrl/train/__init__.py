"""Training loops (docs/architecture.md): read top to bottom, one loop for every flow policy."""
