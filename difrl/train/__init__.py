"""Training loops (DESIGN.md): read top to bottom, one loop for every flow policy."""
