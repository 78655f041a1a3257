"""The tools beside the core: the bench (setups, workloads, the table of measured rows and its
plot), the solver table, and the built-in small models the demo, the bench and the examples train.
The core (what users import: ckpt_fx.backend, rewrite_graph, policies, explain, fit, peak_bytes)
never imports from here."""
