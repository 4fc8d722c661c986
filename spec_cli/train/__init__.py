"""Draft heads trained on a frozen target: the training data (data), the target's features (mtp_features) and the
MTP head's trainer (mtp)."""
