"""The STEM tables' training path, below checkpointing and the step planner (both read it)
and above the model: one partition class per way of keeping and updating the rows
(`partition.py`, over `shards.py`'s row ownership), one collective helper that knows each
group's device (`comm.py`), the Adam kernel (`adam.py`), the overlapped update
(`overlap.py`), host-resident tables (`host_tables.py`, `row_gather.py`), a step's row
gradients (`row_grads.py`), the states in checkpoint order (`states.py`), and the
trainer-facing facade (`optimizer.py`). Which layouts train is the recipe's rule:
`config/table_layout.py`."""
