"""The optimizer side of the engine, on this rank's fp32 master partitions: the partitioned optimizer
(``optimizer``: overflow check, global-norm clipping, the inner torch step), fp16 loss scaling
(``loss_scaler``) and DeepSpeed's learning-rate schedules (``scheduler``)."""
