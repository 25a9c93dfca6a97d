"""Writer identities: who wrote each record of the log, and what each writer may write."""
