"""`difrl plan`: the trainers' own setup and one iteration at real size, on a simulated cluster."""
