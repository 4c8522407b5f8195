"""Sync: what is synced, the all-reduce that agrees on the mean, and state transfer to joiners."""
