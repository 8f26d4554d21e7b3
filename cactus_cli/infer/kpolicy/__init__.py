"""The k policy, one file per concern: what a step costs on this machine (costs), how often drafts are
accepted (rates), and choosing every slot's k from both (policy)."""
