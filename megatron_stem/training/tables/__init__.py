"""The STEM tables' training path: one layout description (`layout.py`), one partition
class per way of keeping and updating the rows (`partition.py`, over `shards.py`'s row
ownership), one collective helper that knows each group's device (`comm.py`), the Adam
kernel (`adam.py`), the overlapped update (`overlap.py`), and the trainer-facing facade
(`optimizer.py`). Nothing is imported here: `layout.py` is read by the config loader."""
