"""DSpark speculative decoding: the drafter (model.py), its proposer (proposer.py) and its training
(train.py)."""
