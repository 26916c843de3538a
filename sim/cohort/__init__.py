"""The sim's cohort: many emulated devices trained as one batched computation."""
