"""Bungee's Slurm pool: agents submitted as Slurm batch jobs when the jobs want more devices
than the cluster has, and cancelled when idle (portal.slurm.pool, sized by portal.slurm.sizing,
through portal.slurm.commands; settings in portal.slurm.config)."""
