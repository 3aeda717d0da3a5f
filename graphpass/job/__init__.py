"""A whole training job's memory: ``graphpass.estimate`` (``job/estimate.py``) predicts one
training step's peak per device, with torch's memory trackers under fake tensors."""
