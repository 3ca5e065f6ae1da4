"""The trainer's side of the pipeline: verified samples as training batches."""
