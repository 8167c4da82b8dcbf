"""Interpretability analyses of STEM models, in numbers and plots.

  spread.py    angular spread: pairwise |cos| of table rows (or of a dense model's
               up-projection outputs), P50/P95/P99, against random Gaussian vectors
  capacity.py  distinct STEM parameters a context activates, against its length
  text.py      token ids of real text (the data readers' formats), read up to a budget
  report.py    the whole analysis of one model (and an optional dense baseline) as a
               JSON-able dict, with the accounting report (total/active/FLOPs/ROI)
  plots.py     PNG plots of the two curves (matplotlib, imported only here)
"""
