"""Draft heads trained on a frozen target: the data (data, requests; eagle3_data), the target's view of it
(target_pass; mtp_features), the optimisation loop both trainers run (loop), and the trainers (mtp, eagle3)."""
