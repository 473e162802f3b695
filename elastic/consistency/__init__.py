"""Accuracy-consistent elasticity: pieces that make a job's result independent of how many
workers it had, when, and where its virtual workers ran."""
