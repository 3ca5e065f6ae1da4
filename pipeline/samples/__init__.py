"""Accepted samples kept on local disk by a run, and their export for a trainer."""
