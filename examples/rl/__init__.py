"""Weight refit for RL from ucpd's RAM copy (refit.py)."""
