from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0005_signin_attempts"),
    ]

    operations = [
        migrations.AddField(
            model_name="team",
            name="response_storage_bytes",
            field=models.PositiveBigIntegerField(
                blank=True,
                help_text="Bytes of stored /v1/responses responses the team may keep. Empty: "
                "ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM.",
                null=True,
                verbose_name="stored responses quota (bytes)",
            ),
        ),
    ]
